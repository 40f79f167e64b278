/* Paged decode attention for CPUs: each query token attends over its sequence's cached K/V, read in
 * place through the block table (no gather into a contiguous copy).
 *
 * Built at run time by ppserve/model/ops/build.py with the system C compiler and loaded with ctypes.
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

#include "bf16.h"

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }

static inline float load_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void store_bf16(uint16_t *p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

#define MAX_HEAD_DIM 256
#define CACHE_LINE 64

/* The bf16 fast path works a block at a time. Where the CPU or the shape does not allow it, the block
 * functions return 0 and the generic per-token loops below run instead (always for float32, whose loops
 * the compiler vectorises well). */

/* Prefetch part k of `parts` of the next block: spread over the work on this block, so the prefetches
 * never queue up behind each other (a whole block at once stalled on full fill buffers). */
static inline void prefetch_part(const void *next, int64_t bytes, int64_t k, int64_t parts) {
    if (next == NULL) return;
    const int64_t lines = (bytes + CACHE_LINE - 1) / CACHE_LINE;
    for (int64_t l = lines * k / parts; l < lines * (k + 1) / parts; l++)
        __builtin_prefetch((const char *)next + l * CACHE_LINE, 0, 3);
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* The 16 horizontal sums of a[0..15], in order, in one vector: a transpose-and-add tree (30 shuffles and
 * 15 adds) instead of 16 separate horizontal reductions. */
static inline __m512 reduce16(const __m512 a[16]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: pairs of a[2i], a[2i+1] half summed */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per lane: the lane sums of a[4i..4i+3] */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* add lanes pairwise */
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}
#endif

/* scores[(h * g + j) * ctx + t0 + t] = scale * (q_{h,j} . k_t) for the len tokens of one block, with the
 * AVX512-BF16 pair-dot instruction (bf16 products are exact in float32 and summed in float32): 16 tokens
 * at a time, one vector store per 16 scores. */
static inline int block_scores_bf16(const uint16_t *qs, const uint16_t *kb, int64_t len, int64_t hkv, int64_t g,
                                    int64_t d, float scale, float *scores, int64_t ctx, int64_t t0,
                                    const void *next, int64_t block_bytes) {
#if defined(__AVX512BF16__)
    if (d % 32 != 0) return 0;
    const int64_t nc = d / 32, row = hkv * d;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t h = 0; h < hkv; h++)
        for (int64_t j = 0; j < g; j++) {
            prefetch_part(next, block_bytes, h * g + j, hkv * g);
            __m512bh qv[MAX_HEAD_DIM / 32];
            const uint16_t *qh = qs + (h * g + j) * d;
            for (int64_t c = 0; c < nc; c++) qv[c] = (__m512bh)_mm512_loadu_si512((const void *)(qh + 32 * c));
            float *dst = scores + (h * g + j) * ctx + t0;
            for (int64_t t = 0; t < len; t += 16) {
                const int64_t m = len - t < 16 ? len - t : 16;
                __m512 a[16];
                for (int64_t u = 0; u < 16; u++) {
                    __m512 acc = _mm512_setzero_ps();
                    const uint16_t *k = kb + (t + u) * row + h * d;
                    for (int64_t c = 0; u < m && c < nc; c++)
                        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512((const void *)(k + 32 * c)));
                    a[u] = acc;
                }
                _mm512_mask_storeu_ps(dst + t, (__mmask16)((1u << m) - 1u), _mm512_mul_ps(reduce16(a), vscale));
            }
        }
    return 1;
#else
    (void)qs, (void)kb, (void)len, (void)hkv, (void)g, (void)d, (void)scale, (void)scores, (void)ctx, (void)t0;
    (void)next, (void)block_bytes;
    return 0;
#endif
}

/* acc[(h * g + j) * d + i] += p[(h * g + j) * ctx + t0 + t] * v_t[h * d + i] over the len tokens of one
 * block. Each V row is widened to float32 once (16 tokens at a time, into an L1-resident scratch), and
 * one query head's accumulators stay in registers across those tokens instead of being loaded and stored
 * for every token. */
static inline int block_values_bf16(const uint16_t *vb, int64_t len, int64_t hkv, int64_t g, int64_t d,
                                    const float *p, int64_t ctx, int64_t t0, float *acc, const void *next,
                                    int64_t block_bytes) {
#if defined(__AVX512BF16__)
    if (d % 16 != 0 || d > 128) return 0;
    const int64_t nv = d / 16, row = hkv * d;
    float vf[16 * 128] __attribute__((aligned(64)));
    for (int64_t h = 0; h < hkv; h++)
        for (int64_t t = 0; t < len; t += 16) {
            const int64_t m = len - t < 16 ? len - t : 16;
            for (int64_t u = 0; u < m; u++)
                for (int64_t c = 0; c < nv; c++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(vb + (t + u) * row + h * d + 16 * c));
                    _mm512_store_ps(vf + u * d + 16 * c,
                                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
                }
            for (int64_t j = 0; j < g; j++) {
                if (t == 0) prefetch_part(next, block_bytes, h * g + j, hkv * g);
                float *ah = acc + (h * g + j) * d;
                const float *ph = p + (h * g + j) * ctx + t0 + t;
                __m512 r[8];
                for (int64_t c = 0; c < nv; c++) r[c] = _mm512_loadu_ps(ah + 16 * c);
                for (int64_t u = 0; u < m; u++) {
                    const __m512 pu = _mm512_set1_ps(ph[u]);
                    for (int64_t c = 0; c < nv; c++) r[c] = _mm512_fmadd_ps(pu, _mm512_load_ps(vf + u * d + 16 * c), r[c]);
                }
                for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(ah + 16 * c, r[c]);
            }
        }
    return 1;
#else
    (void)vb, (void)len, (void)hkv, (void)g, (void)d, (void)p, (void)ctx, (void)t0, (void)acc, (void)next;
    (void)block_bytes;
    return 0;
#endif
}

static inline int block_scores_f32(const float *qs, const float *kb, int64_t len, int64_t hkv, int64_t g,
                                   int64_t d, float scale, float *scores, int64_t ctx, int64_t t0,
                                   const void *next, int64_t block_bytes) {
    (void)qs, (void)kb, (void)len, (void)hkv, (void)g, (void)d, (void)scale, (void)scores, (void)ctx, (void)t0;
    (void)next, (void)block_bytes;
    return 0;
}

static inline int block_values_f32(const float *vb, int64_t len, int64_t hkv, int64_t g, int64_t d,
                                   const float *p, int64_t ctx, int64_t t0, float *acc, const void *next,
                                   int64_t block_bytes) {
    (void)vb, (void)len, (void)hkv, (void)g, (void)d, (void)p, (void)ctx, (void)t0, (void)acc, (void)next;
    (void)block_bytes;
    return 0;
}

/* Prefetch one token row (all KV heads) of the next block while this block is computed: blocks are
 * scattered through the cache, so the hardware prefetcher loses the stream at every block boundary. */
static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += CACHE_LINE) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* One work item = one sequence, all its heads: each block is then read as one contiguous stretch
 * (bs * hkv * d elements) instead of hkv interleaved strided passes. */
#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE, BLOCK_SCORES, BLOCK_VALUES)                                                        \
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
                    if (BLOCK_SCORES(qs, kb, len, hkv, g, d, scale, scores, ctx, t0, next, bs * row_bytes)) \
                        continue;                                                                           \
                    for (int64_t t = 0; t < len; t++) {                                                     \
                        if (next != NULL) prefetch_row(next + t * row, row_bytes);                          \
                        for (int64_t h = 0; h < hkv; h++) {                                                 \
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
                    if (BLOCK_VALUES(vb, len, hkv, g, d, scores, ctx, t0, acc, next, bs * row_bytes))       \
                        continue;                                                                           \
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

DEFINE_PAGED_DECODE(paged_decode_f32, float, load_f32, store_f32, block_scores_f32, block_values_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, load_bf16, store_bf16, block_scores_bf16, block_values_bf16)
