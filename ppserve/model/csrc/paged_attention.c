/* Paged decode attention for CPUs: each query token attends over its sequence's cached K/V, read in
 * place through the block table (no gather into a contiguous copy).
 *
 * Built at run time by ppserve/model/cpu_kernels.py with the system C compiler and loaded with ctypes.
 * It links the same libgomp that torch loaded (soname libgomp.so.1), so its OpenMP threads are torch's.
 *
 * Layouts (all contiguous, row-major):
 *   q            [n, hq, d]                one query token per sequence
 *   k_cache      [num_blocks, bs, hkv, d]  (v_cache the same)
 *   block_tables [n, bt_stride] int64      block ids of each sequence's context, in order
 *   context_lens [n] int64                 tokens of context each query sees (its own included)
 *   out          [n, hq, d]
 * Work item = one sequence: its blocks are read contiguously, all heads at once, and the hq/hkv query
 * heads of a KV head share every K/V row read, so each cached row is loaded once per step. Scores and accumulators are float32 whatever the storage type.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }

static inline float load_bf16(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void store_bf16(uint16_t *p, int64_t i, float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) { /* NaN stays NaN */
        p[i] = (uint16_t)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    p[i] = (uint16_t)(u >> 16);
}

#define MAX_HEAD_DIM 256
#define CACHE_LINE 64

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

/* dots[j * stride] = scale * (q_j . k) for the g query heads q (bf16, rows d apart) of one KV head, with
 * the AVX512-BF16 pair-dot instruction: no conversion of K to float32 and half the multiply-adds. The
 * products of bf16 values are exact in float32 and accumulated in float32. Returns 0 where unsupported. */
static inline int dots_bf16(const uint16_t *q, const uint16_t *k, int64_t g, int64_t d, float scale, float *dots,
                            int64_t stride) {
#if defined(__AVX512BF16__)
    if (d % 32 != 0) return 0;
    __m512bh kc[MAX_HEAD_DIM / 32];
    for (int64_t c = 0; c < d / 32; c++) kc[c] = (__m512bh)_mm512_loadu_si512((const void *)(k + 32 * c));
    for (int64_t j = 0; j < g; j++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < d / 32; c++)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(q + j * d + 32 * c)), kc[c]);
        dots[j * stride] = scale * _mm512_reduce_add_ps(acc);
    }
    return 1;
#else
    (void)q, (void)k, (void)g, (void)d, (void)scale, (void)dots, (void)stride;
    return 0;
#endif
}

static inline int dots_f32(const float *q, const float *k, int64_t g, int64_t d, float scale, float *dots,
                           int64_t stride) {
    (void)q, (void)k, (void)g, (void)d, (void)scale, (void)dots, (void)stride;
    return 0; /* the generic loop below vectorises well for float32 */
}

/* Prefetch one token row (all KV heads) of the next block while this block is computed: blocks are
 * scattered through the cache, so the hardware prefetcher loses the stream at every block boundary. */
static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += CACHE_LINE) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* One work item = one sequence, all its heads: each block is then read as one contiguous stretch
 * (bs * hkv * d elements) instead of hkv interleaved strided passes. */
#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE, DOTS)                                                        \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables, int64_t bt_stride, \
             const int64_t *context_lens, T *out, int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t bs,  \
             float scale, int num_threads) {                                                                \
        if (d > MAX_HEAD_DIM || hkv <= 0 || hq % hkv != 0) return 1;                                       \
        const int64_t g = hq / hkv, row = hkv * d; /* row: elements between consecutive tokens */           \
        const int64_t row_bytes = row * (int64_t)sizeof(T);                                                 \
        int failed = 0;                                                                                     \
        _Pragma("omp parallel num_threads(num_threads)") {                                                  \
            float kv[MAX_HEAD_DIM];                                                                         \
            float *qf = (float *)malloc(sizeof(float) * (size_t)(2 * hq * d));                              \
            float *acc = qf + hq * d;                                                                       \
            float *scores = NULL;                                                                           \
            int64_t capacity = 0;                                                                           \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t s = 0; s < n; s++) {                       \
                const int64_t ctx = context_lens[s];                                                        \
                if (ctx > capacity && qf != NULL) {                                                         \
                    free(scores);                                                                           \
                    capacity = ctx;                                                                         \
                    scores = (float *)malloc(sizeof(float) * (size_t)(hq * capacity));                      \
                }                                                                                           \
                if (qf == NULL || scores == NULL) {                                                         \
                    capacity = 0;                                                                           \
                    _Pragma("omp atomic write") failed = 1;                                                 \
                    continue;                                                                               \
                }                                                                                           \
                const T *qs = q + s * hq * d;                                                               \
                for (int64_t i = 0; i < hq * d; i++) qf[i] = LOAD(qs, i) * scale;                           \
                const int64_t *table = block_tables + s * bt_stride;                                        \
                const int64_t nblocks = (ctx + bs - 1) / bs;                                                \
                /* scores[head, t] = q_head . k_t, head = h * g + j shares KV head h */                     \
                for (int64_t b = 0; b < nblocks; b++) {                                                     \
                    const int64_t t0 = b * bs, len = ctx - t0 < bs ? ctx - t0 : bs;                         \
                    const T *kb = k_cache + table[b] * bs * row;                                            \
                    const T *next = b + 1 < nblocks ? k_cache + table[b + 1] * bs * row : NULL;             \
                    for (int64_t t = 0; t < len; t++) {                                                     \
                        if (next != NULL) prefetch_row(next + t * row, row_bytes);                          \
                        for (int64_t h = 0; h < hkv; h++) {                                                 \
                            if (DOTS(qs + h * g * d, kb + t * row + h * d, g, d, scale,                     \
                                     scores + h * g * ctx + t0 + t, ctx))                                   \
                                continue;                                                                   \
                            for (int64_t i = 0; i < d; i++) kv[i] = LOAD(kb + t * row + h * d, i);          \
                            for (int64_t j = 0; j < g; j++) {                                               \
                                const float *qh = qf + (h * g + j) * d;                                     \
                                float dot = 0.f;                                                            \
                                for (int64_t i = 0; i < d; i++) dot += qh[i] * kv[i];                       \
                                scores[(h * g + j) * ctx + t0 + t] = dot;                                   \
                            }                                                                               \
                        }                                                                                   \
                    }                                                                                       \
                }                                                                                           \
                /* softmax numerators in place; the 1/sum is applied to the output once (qf reused) */      \
                for (int64_t k = 0; k < hq; k++) {                                                          \
                    float *sk = scores + k * ctx, m = -INFINITY, sum = 0.f;                                 \
                    for (int64_t t = 0; t < ctx; t++) m = sk[t] > m ? sk[t] : m;                            \
                    for (int64_t t = 0; t < ctx; t++) {                                                     \
                        sk[t] = expf(sk[t] - m);                                                            \
                        sum += sk[t];                                                                       \
                    }                                                                                       \
                    qf[k] = 1.f / sum;                                                                      \
                }                                                                                           \
                memset(acc, 0, sizeof(float) * (size_t)(hq * d));                                           \
                for (int64_t b = 0; b < nblocks; b++) {                                                     \
                    const int64_t t0 = b * bs, len = ctx - t0 < bs ? ctx - t0 : bs;                         \
                    const T *vb = v_cache + table[b] * bs * row;                                            \
                    const T *next = b + 1 < nblocks ? v_cache + table[b + 1] * bs * row : NULL;             \
                    for (int64_t t = 0; t < len; t++) {                                                     \
                        if (next != NULL) prefetch_row(next + t * row, row_bytes);                          \
                        for (int64_t h = 0; h < hkv; h++) {                                                 \
                            for (int64_t i = 0; i < d; i++) kv[i] = LOAD(vb + t * row + h * d, i);          \
                            for (int64_t j = 0; j < g; j++) {                                               \
                                const float p = scores[(h * g + j) * ctx + t0 + t];                         \
                                float *ah = acc + (h * g + j) * d;                                          \
                                for (int64_t i = 0; i < d; i++) ah[i] += p * kv[i];                         \
                            }                                                                               \
                        }                                                                                   \
                    }                                                                                       \
                }                                                                                           \
                T *os = out + s * hq * d;                                                                   \
                for (int64_t k = 0; k < hq; k++)                                                            \
                    for (int64_t i = 0; i < d; i++) STORE(os, k * d + i, acc[k * d + i] * qf[k]);           \
            }                                                                                               \
            free(scores);                                                                                   \
            free(qf);                                                                                       \
        }                                                                                                   \
        return failed ? 2 : 0;                                                                              \
    }

DEFINE_PAGED_DECODE(paged_decode_f32, float, load_f32, store_f32, dots_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, load_bf16, store_bf16, dots_bf16)
