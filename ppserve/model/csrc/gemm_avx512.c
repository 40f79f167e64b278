/* bf16 GEMM with AVX512-BF16 dot products: out[M, N] = a[M, K] @ W[N, K]^T (+ bias), float32 accumulation,
 * one rounding to bf16 at the end (as oneDNN and gemm_amx.c do). For CPUs with AVX512-BF16 and no AMX
 * (AMD Zen 4 and later, Intel Cooper Lake); gemm_amx.c is the AMX one.
 *
 * Why our own: a decode step multiplies a few rows by every weight of the model once, so it is bound by
 * reading the weights. On a Zen 4 oneDNN ran this model's decode GEMMs (8 rows, 576..3072 x 576) at
 * ~7 GB/s of weights, most of them zero-padded to 32 or 64 rows by the path its timing picked; 90 % of the
 * decode step was those GEMMs. Here each thread streams its share of the weights exactly once whatever M
 * is small, and every 64-byte weight load feeds MR rows of dot products.
 *
 * W is prepacked in the AMX kernel's layout (ops/native.py PanelGemm.pack): 16-column panels,
 *   packed[n / 16][k / 32][kk = 0..15][nn = 0..15][2] = W[n16 + nn][k32 + 2 kk + {0, 1}],
 * so k pair j = 16 (k / 32) + kk of a panel is one contiguous 64-byte vector: lane nn holds
 * (W[n16 + nn][2j], W[n16 + nn][2j + 1]), exactly vdpbf16ps's second operand against a broadcast pair
 * (a[r][2j], a[r][2j + 1]). One micro-kernel call computes MR rows x NP panels (MR x 16 NP outputs) in
 * MR x NP accumulator registers: NP weight loads and MR broadcasts per k pair, MR x NP dot products.
 * Shapes: N and K multiples of 32 (the packing's), any M. The gate/up epilogue (silu_mul) takes the
 * panels of PanelGemm.pack_gate_up, alternating gate and up, and rounds as the eager chain does. */
#include <stdint.h>
#include <string.h>

#include "vec_bf16.h"

#if defined(VEC_BF16)
#include <omp.h>

#define NP 4 /* panels (16 columns each) per micro-kernel: 64 output columns */
#define MR 6 /* rows per micro-kernel: 6 x 4 accumulators + 4 weights + 1 broadcast = 29 of 32 registers */

static inline __m512bh pair(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* acc[r][p] = sum over k pairs of a[r] . W(panel p) for `rows` (a compile-time constant once inlined)
 * rows of a and `panels` panels starting at w (`panel` uint16 apart). */
static inline __attribute__((always_inline)) void micro(const uint16_t *a, int64_t lda, int rows, const uint16_t *w,
                                                         int64_t panel, int panels, int64_t pairs,
                                                         __m512 acc[MR][NP]) {
    /* Local accumulators, copied out at the end: __m512 may alias anything, so sums kept in `acc` itself
     * would go to memory at every step. */
    __m512 c[MR][NP];
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < NP; p++) c[r][p] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) {
        __m512bh wv[NP];
        for (int p = 0; p < NP; p++)
            if (p < panels) wv[p] = (__m512bh)_mm512_loadu_si512((const void *)(w + p * panel + 32 * j));
        for (int r = 0; r < MR; r++) {
            if (r >= rows) break;
            const __m512bh av = pair(a + r * lda + 2 * j);
            for (int p = 0; p < NP; p++)
                if (p < panels) c[r][p] = _mm512_dpbf16_ps(c[r][p], av, wv[p]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < panels; p++) acc[r][p] = c[r][p];
}

/* The micro-kernel specialised for every (rows, panels) a call can have, so that its loops unroll and
 * the accumulators stay in registers. */
#define MICRO(R, P)                                                                                          \
    static void micro_##R##_##P(const uint16_t *a, int64_t lda, const uint16_t *w, int64_t panel, int64_t pairs, \
                                __m512 acc[MR][NP]) {                                                       \
        micro(a, lda, R, w, panel, P, pairs, acc);                                                          \
    }
#define MICRO_ROWS(R) MICRO(R, 1) MICRO(R, 2) MICRO(R, 3) MICRO(R, 4)
MICRO_ROWS(1)
MICRO_ROWS(2)
MICRO_ROWS(3)
MICRO_ROWS(4)
MICRO_ROWS(5)
MICRO_ROWS(6)

typedef void (*micro_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, __m512[MR][NP]);
#define ROW_FNS(R) {micro_##R##_1, micro_##R##_2, micro_##R##_3, micro_##R##_4}
static const micro_fn MICROS[MR][NP] = {ROW_FNS(1), ROW_FNS(2), ROW_FNS(3), ROW_FNS(4), ROW_FNS(5), ROW_FNS(6)};

/* Micro-kernel groups (NP panels) a thread sweeps for each row block before moving on: at K = 1536 one
 * group is 192 KiB, so a sweep stays in L2 across the row blocks while A's rows come from L1. */
#define GROUPS_PER_SWEEP 2

/* One thread's share of out [M, N] = a W^T (+ bias; or silu(gate) * up, see gemm_bf16_avx512): the output
 * columns of panels lo .. hi - 1 (lo, hi even), every row. Each thread streams its share of W once (from
 * memory; later row blocks read it from L2). */
static void gemm_share(const uint16_t *a, int64_t lda, const uint16_t *w_packed, const uint16_t *bias, uint16_t *out,
                       int64_t ldc, int64_t m, int64_t k, int silu_mul, int64_t lo, int64_t hi) {
    const int64_t pairs = k / 2, panel = k * 16; /* uint16 per 16-column panel */
    __m512 acc[MR][NP];
    for (int64_t s0 = lo; s0 < hi; s0 += NP * GROUPS_PER_SWEEP) {
        const int64_t s1 = s0 + NP * GROUPS_PER_SWEEP < hi ? s0 + NP * GROUPS_PER_SWEEP : hi;
        for (int64_t r0 = 0; r0 < m; r0 += MR) {
            const int rows = m - r0 < MR ? (int)(m - r0) : MR;
            for (int64_t p0 = s0; p0 < s1; p0 += NP) {
                const int np = s1 - p0 < NP ? (int)(s1 - p0) : NP; /* even: units are panel pairs */
                MICROS[rows - 1][np - 1](a + r0 * lda, lda, w_packed + p0 * panel, panel, pairs, acc);
                for (int r = 0; r < rows; r++) {
                    uint16_t *o = out + (r0 + r) * ldc;
                    if (silu_mul) { /* panels 2q, 2q + 1: gate and up of output columns 16q .. 16q + 15 */
                        for (int p = 0; p < np; p += 2) {
                            const __m512 gate = vround_f32(acc[r][p]), up = vround_f32(acc[r][p + 1]);
                            _mm256_storeu_si256((__m256i *)(o + (p0 + p) * 8), vround(vsilu_mul(gate, up)));
                        }
                        continue;
                    }
                    for (int p = 0; p < np; p++) {
                        const __m512 b = bias ? vload(bias + (p0 + p) * 16, 0xffff) : _mm512_setzero_ps();
                        _mm256_storeu_si256((__m256i *)(o + (p0 + p) * 16), vround(_mm512_add_ps(acc[r][p], b)));
                    }
                }
            }
        }
    }
}

/* Threads split the columns in units of two panels (a gate/up pair for silu_mul), not in whole micro-
 * kernel groups: 36 panels (N = 576) are 9 groups of 4, which two threads would share 5 : 4. */
static inline int64_t share_start(int64_t units, int64_t tid, int64_t nt) { return 2 * (units * tid / nt); }

/* silu_mul = 0: out [M, N] = a W^T + bias. silu_mul = 1: W's panels alternate gate, up and out [M, N/2]
 * = silu(gate) * up (no bias). Returns 0, 1 = unsupported shape, 3 = not built with AVX512-BF16. */
int gemm_bf16_avx512(const uint16_t *a, int64_t lda, const uint16_t *w_packed, const uint16_t *bias, uint16_t *out,
                     int64_t ldc, int64_t m, int64_t n, int64_t k, int silu_mul, int num_threads) {
    if (n % 32 || k % 32 || m <= 0 || n <= 0 || k <= 0 || (silu_mul && bias)) return 1;
    const int64_t units = n / 32;
    const int threads = num_threads < units ? num_threads : (int)units;
#pragma omp parallel num_threads(threads)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        gemm_share(a, lda, w_packed, bias, out, ldc, m, k, silu_mul, share_start(units, tid, nt),
                   share_start(units, tid + 1, nt));
    }
    return 0;
}

/* The experts of a mixture-of-experts layer in one parallel region: rows ends[e - 1] .. ends[e] - 1 of a
 * (sorted by expert, ends[-1] = 0) times expert e's packed weight (w_packed + e * expert_stride), into
 * the same rows of out; no bias. One call instead of one per expert saves each expert's call, output
 * allocation, slicing and copy, which at a decode step's few rows per expert cost about what the
 * multiplication does. Each thread takes its column share of every expert in turn. Returns as
 * gemm_bf16_avx512; 2 = ends not non-decreasing. */
int grouped_gemm_bf16_avx512(const uint16_t *a, int64_t lda, const uint16_t *w_packed, int64_t expert_stride,
                             const int32_t *ends, int64_t num_experts, uint16_t *out, int64_t ldc, int64_t n,
                             int64_t k, int silu_mul, int num_threads) {
    if (n % 32 || k % 32 || n <= 0 || k <= 0 || num_experts <= 0) return 1;
    for (int64_t e = 0, start = 0; e < num_experts; start = ends[e], e++)
        if (ends[e] < start) return 2;
    const int64_t units = n / 32;
    const int threads = num_threads < units ? num_threads : (int)units;
#pragma omp parallel num_threads(threads)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t lo = share_start(units, tid, nt), hi = share_start(units, tid + 1, nt);
        for (int64_t e = 0, start = 0; e < num_experts; start = ends[e], e++)
            if (ends[e] > start)
                gemm_share(a + start * lda, lda, w_packed + e * expert_stride, NULL, out + start * ldc, ldc,
                           ends[e] - start, k, silu_mul, lo, hi);
    }
    return 0;
}

int gemm_bf16_avx512_built(void) { return 1; }
#else
int gemm_bf16_avx512(const uint16_t *a, int64_t lda, const uint16_t *w_packed, const uint16_t *bias, uint16_t *out,
                     int64_t ldc, int64_t m, int64_t n, int64_t k, int silu_mul, int num_threads) {
    (void)a, (void)lda, (void)w_packed, (void)bias, (void)out, (void)ldc, (void)m, (void)n, (void)k, (void)silu_mul;
    (void)num_threads;
    return 3; /* not built with AVX512-BF16 */
}

int grouped_gemm_bf16_avx512(const uint16_t *a, int64_t lda, const uint16_t *w_packed, int64_t expert_stride,
                             const int32_t *ends, int64_t num_experts, uint16_t *out, int64_t ldc, int64_t n,
                             int64_t k, int silu_mul, int num_threads) {
    (void)a, (void)lda, (void)w_packed, (void)expert_stride, (void)ends, (void)num_experts, (void)out, (void)ldc;
    (void)n, (void)k, (void)silu_mul, (void)num_threads;
    return 3; /* not built with AVX512-BF16 */
}

int gemm_bf16_avx512_built(void) { return 0; }
#endif
