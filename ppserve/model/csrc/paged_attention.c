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
 * Work item = (sequence, kv head): its hq/hkv query heads share every K/V row read, so each cached
 * row is loaded once per step. Scores and accumulators are float32 whatever the storage type.
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
#define MAX_GROUP 64

#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE)                                                          \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables, int64_t bt_stride, \
             const int64_t *context_lens, T *out, int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t bs,  \
             float scale, int num_threads) {                                                                \
        if (d > MAX_HEAD_DIM || hkv <= 0 || hq % hkv != 0 || hq / hkv > MAX_GROUP) return 1;               \
        const int64_t g = hq / hkv, row = hkv * d; /* row: elements between consecutive tokens */           \
        int failed = 0;                                                                                     \
        _Pragma("omp parallel num_threads(num_threads)") {                                                  \
            float qf[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM], kv[MAX_HEAD_DIM];            \
            float *scores = NULL;                                                                           \
            int64_t capacity = 0;                                                                           \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t w = 0; w < n * hkv; w++) {                 \
                const int64_t s = w / hkv, h = w % hkv, ctx = context_lens[s];                              \
                if (ctx > capacity) {                                                                       \
                    free(scores);                                                                           \
                    capacity = ctx;                                                                         \
                    scores = (float *)malloc(sizeof(float) * (size_t)(g * capacity));                       \
                    if (scores == NULL) {                                                                   \
                        capacity = 0;                                                                       \
                        _Pragma("omp atomic write") failed = 1;                                             \
                        continue;                                                                           \
                    }                                                                                       \
                }                                                                                           \
                const T *qs = q + (s * hq + h * g) * d;                                                     \
                for (int64_t i = 0; i < g * d; i++) qf[i] = LOAD(qs, i) * scale;                            \
                const int64_t *table = block_tables + s * bt_stride;                                        \
                /* scores[j, t] = q_j . k_t */                                                              \
                for (int64_t t0 = 0; t0 < ctx; t0 += bs) {                                                  \
                    const int64_t len = ctx - t0 < bs ? ctx - t0 : bs;                                      \
                    const T *kb = k_cache + table[t0 / bs] * bs * row + h * d;                              \
                    for (int64_t t = 0; t < len; t++) {                                                     \
                        for (int64_t i = 0; i < d; i++) kv[i] = LOAD(kb + t * row, i);                      \
                        for (int64_t j = 0; j < g; j++) {                                                   \
                            float dot = 0.f;                                                                \
                            for (int64_t i = 0; i < d; i++) dot += qf[j * d + i] * kv[i];                   \
                            scores[j * ctx + t0 + t] = dot;                                                 \
                        }                                                                                   \
                    }                                                                                       \
                }                                                                                           \
                /* softmax numerators; the 1/sum is applied to the output once */                           \
                float inv_sum[MAX_GROUP];                                                                   \
                for (int64_t j = 0; j < g; j++) {                                                           \
                    float *sj = scores + j * ctx, m = -INFINITY, sum = 0.f;                                 \
                    for (int64_t t = 0; t < ctx; t++) m = sj[t] > m ? sj[t] : m;                            \
                    for (int64_t t = 0; t < ctx; t++) {                                                     \
                        sj[t] = expf(sj[t] - m);                                                            \
                        sum += sj[t];                                                                       \
                    }                                                                                       \
                    inv_sum[j] = 1.f / sum;                                                                 \
                }                                                                                           \
                memset(acc, 0, sizeof(float) * (size_t)(g * d));                                            \
                for (int64_t t0 = 0; t0 < ctx; t0 += bs) {                                                  \
                    const int64_t len = ctx - t0 < bs ? ctx - t0 : bs;                                      \
                    const T *vb = v_cache + table[t0 / bs] * bs * row + h * d;                              \
                    for (int64_t t = 0; t < len; t++) {                                                     \
                        for (int64_t i = 0; i < d; i++) kv[i] = LOAD(vb + t * row, i);                      \
                        for (int64_t j = 0; j < g; j++) {                                                   \
                            const float p = scores[j * ctx + t0 + t];                                       \
                            for (int64_t i = 0; i < d; i++) acc[j * d + i] += p * kv[i];                    \
                        }                                                                                   \
                    }                                                                                       \
                }                                                                                           \
                T *os = out + (s * hq + h * g) * d;                                                         \
                for (int64_t j = 0; j < g; j++)                                                             \
                    for (int64_t i = 0; i < d; i++) STORE(os, j * d + i, acc[j * d + i] * inv_sum[j]);      \
            }                                                                                               \
            free(scores);                                                                                   \
        }                                                                                                   \
        return failed ? 2 : 0;                                                                              \
    }

DEFINE_PAGED_DECODE(paged_decode_f32, float, load_f32, store_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, load_bf16, store_bf16)
