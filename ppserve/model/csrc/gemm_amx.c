/* bf16 GEMM on Intel AMX: out[M, N] = a[M, K] @ W[N, K]^T (+ bias), float32 accumulation, one rounding
 * to bf16 at the end (what oneDNN does too).
 *
 * Why our own: oneDNN's AMX brgemm reached ~680 GFLOP/s on two cores at this model's shapes (K = 576 or
 * 1536, N = 576..3072, M = 32..512), while one core's tile unit measures ~1.3 TFLOP/s in a tight loop.
 * The kernel is the textbook 2x2 register blocking: 4 accumulator tiles (32 x 32 outputs), 2 A tiles
 * (16 rows x 32 k each) and 2 B tiles (32 k x 16 columns each), 8 tiles in all.
 *
 * W is prepacked once (ops/native.py) into AMX's pair-interleaved ("VNNI") layout, 16 output columns
 * per panel: packed[n / 16][k / 32][kk = 0..15][nn = 0..15][2] = W[n16 + nn][k32 + 2 kk + {0, 1}], so
 * every B tile is one contiguous 1 KiB load. Shapes: N and K multiples of 32 (other shapes use oneDNN),
 * any M. Threads split the output columns (each streams its own share of W
 * once) and walk every 32-row block of A, which stays in L2 (see COL_BLOCKS_PER_SWEEP). */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>

#include "amx.h"
#include "vec_bf16.h"

#ifdef HAVE_AMX
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX state only to processes that ask (oneDNN has usually asked already). */
int amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1; }

/* Round the first `rows` rows of a 16 x 16 float tile (+ bias) to bf16 into out (rows ldc apart). */
static inline void store_tile(const float *acc, const uint16_t *bias, uint16_t *out, int64_t ldc, int64_t rows) {
    const __m512 b = bias ? vload(bias, 0xffff) : _mm512_setzero_ps();
    for (int r = 0; r < rows && r < 16; r++)
        _mm256_storeu_si256((__m256i *)(out + r * ldc), vround(_mm512_add_ps(_mm512_loadu_ps(acc + 16 * r), b)));
}

/* The SiLU-and-mul epilogue for a gate/up weight whose 16-column panels alternate gate, up (see
 * PanelGemm.pack_gate_up): out = bf16(bf16(silu(bf16(gate))) * bf16(up)), the eager chain's roundings,
 * written to the first `rows` rows of a 16-column slice of the [M, N/2] output. */
static inline void store_silu_mul(const float *gate, const float *up, uint16_t *out, int64_t ldc, int64_t rows) {
    for (int r = 0; r < rows && r < 16; r++) {
        const __m512 g = vround_f32(_mm512_loadu_ps(gate + 16 * r)), u = vround_f32(_mm512_loadu_ps(up + 16 * r));
        _mm256_storeu_si256((__m256i *)(out + r * ldc), vround(vsilu_mul(g, u)));
    }
}

/* One output block of up to 32 rows x 32 columns: rows a0 (tiles 0, 1 against A tile 4) and, where
 * `bottom`, a0 + 16 lda (tiles 2, 3 against A tile 5), columns of panels b0 and b0 + panel. The tiles are
 * configured to the rows that exist (configure_tile_rows), so the tile unit multiplies and reads only
 * those: a block padded to 32 rows at a decode step's 1-4 rows spent 8-32x the multiplications (576 x 576
 * at one row: 27 us, against 11 for the AVX512-BF16 kernel on the same Xeon; 15 us configured). While it
 * runs, the weights of the next block (`next`, or NULL) are prefetched into L2, spread over the k loop:
 * with few rows a block is short and the weight stream is what limits it. */
static inline void block_x32(const uint16_t *a0, int64_t lda, int bottom, const uint16_t *b0, int64_t panel,
                             int64_t kb_count, const uint16_t *next, float acc[4][256]) {
    const uint16_t *a1 = a0 + 16 * lda, *b1 = b0 + panel;
    const int64_t next_lines = 2 * panel * 2 / 64, per_step = (next_lines + kb_count - 1) / kb_count;
    _tile_zero(0);
    _tile_zero(1);
    if (bottom) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kb = 0; kb < kb_count; kb++) {
        if (next)
            for (int64_t l = kb * per_step; l < (kb + 1) * per_step && l < next_lines; l++)
                _mm_prefetch((const char *)next + 64 * l, _MM_HINT_T1);
        _tile_loadd(4, a0 + kb * 32, lda * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (bottom) {
            _tile_loadd(5, a1 + kb * 32, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    if (bottom) {
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
    }
}

/* Column blocks a thread sweeps for each row block before moving on: their weights (4 x 36 KiB at
 * K = 576) stay in L2 across the row blocks, and each 32-row slice of A stays in L1 across them. */
#define COL_BLOCKS_PER_SWEEP 4

/* One thread's share of a GEMM: output column blocks lo .. hi - 1 (32 columns each) of rows r0 .. r1 - 1,
 * out[r] = a[r] W^T (+ bias; or, with silu_mul, silu(gate) * up, see gemm_bf16_amx). A last block of
 * fewer than 32 rows runs with its tiles configured to those rows (configure_tile_rows): it reads and
 * multiplies only rows that exist, so callers need not pad (padding every GEMM's input with torch.cat
 * cost ~40 us a call at decode sizes), and a grouped call's expert reads none of the next one's rows.
 * `tile_rows`: what this thread's tiles are configured to, updated where a block needs other rows. Each
 * output row's sums run in the same order whatever the block, so a row's result does not depend on the
 * rows beside it. */
static void amx_share(const uint16_t *a, int64_t lda, int64_t r0, int64_t r1, const uint16_t *w_packed,
                      const uint16_t *bias, uint16_t *out, int64_t ldc, int64_t k, int silu_mul, int64_t lo, int64_t hi,
                      float acc[4][256], int *tile_rows) {
    const int64_t kb_count = k / 32, panel = kb_count * 512; /* uint16 per 16-column panel */
    for (int64_t c0 = lo; c0 < hi; c0 += COL_BLOCKS_PER_SWEEP) {
        const int64_t c1 = c0 + COL_BLOCKS_PER_SWEEP < hi ? c0 + COL_BLOCKS_PER_SWEEP : hi;
        for (int64_t r = r0; r < r1; r += 32) {
            const int64_t rows = r1 - r; /* rows of this block that exist (>= 32: all) */
            const int top = rows < 16 ? (int)rows : 16, bottom = rows < 16 ? 0 : rows < 32 ? (int)rows - 16 : 16;
            if (*tile_rows != top * 32 + bottom) {
                *tile_rows = top * 32 + bottom;
                configure_tile_rows(top, bottom);
            }
            const uint16_t *ab = a + r * lda;
            for (int64_t cb = c0; cb < c1; cb++) {
                const uint16_t *w = w_packed + 2 * cb * panel;
                /* Only the first row block reads the weights from memory; prefetch the next ones. */
                const uint16_t *next = r == r0 && cb + 1 < hi ? w + 2 * panel : NULL;
                block_x32(ab, lda, bottom, w, panel, kb_count, next, acc);
                if (silu_mul) { /* tiles 0, 2: gate rows 0-15, 16-31; tiles 1, 3: up */
                    uint16_t *o = out + r * ldc + cb * 16;
                    store_silu_mul(acc[0], acc[1], o, ldc, rows);
                    if (bottom) store_silu_mul(acc[2], acc[3], o + 16 * ldc, ldc, rows - 16);
                    continue;
                }
                uint16_t *o = out + r * ldc + cb * 32;
                const uint16_t *bs = bias ? bias + cb * 32 : NULL;
                store_tile(acc[0], bs, o, ldc, rows);
                store_tile(acc[1], bs ? bs + 16 : NULL, o + 16, ldc, rows);
                if (!bottom) continue;
                store_tile(acc[2], bs, o + 16 * ldc, ldc, rows - 16);
                store_tile(acc[3], bs ? bs + 16 : NULL, o + 16 * ldc + 16, ldc, rows - 16);
            }
        }
    }
}

/* silu_mul = 0: out [M, N] = a W^T + bias. silu_mul = 1: W's panels alternate gate, up and out [M, N/2]
 * = silu(gate) * up (no bias). Threads split the output columns: each streams its own share of W once. */
int gemm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *w_packed, const uint16_t *bias, uint16_t *out,
                  int64_t ldc, int64_t m, int64_t n, int64_t k, int silu_mul, int num_threads) {
    if (n % 32 || k % 32 || m <= 0 || n <= 0 || k <= 0 || (silu_mul && bias)) return 1;
    const int64_t col_blocks = n / 32;
#pragma omp parallel num_threads(num_threads)
    {
        float acc[4][256] __attribute__((aligned(64)));
        const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
        int tile_rows = 0; /* configured by amx_share */
        amx_share(a, lda, 0, m, w_packed, bias, out, ldc, k, silu_mul, col_blocks * tid / threads,
                  col_blocks * (tid + 1) / threads, acc, &tile_rows);
        _tile_release();
    }
    return 0;
}

/* The experts of a mixture-of-experts layer in one parallel region, as grouped_gemm_bf16_avx512 (same
 * arguments and results): rows ends[e - 1] .. ends[e] - 1 of a, sorted by expert, times expert e's packed
 * weight, into the same rows of out. Each thread takes its column share of every expert in turn. Returns 0,
 * 1 = shape, 2 = ends not non-decreasing. */
int grouped_gemm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *w_packed, int64_t expert_stride,
                          const int32_t *ends, int64_t num_experts, uint16_t *out, int64_t ldc, int64_t n, int64_t k,
                          int silu_mul, int num_threads) {
    if (n % 32 || k % 32 || n <= 0 || k <= 0 || num_experts <= 0) return 1;
    for (int64_t e = 0, start = 0; e < num_experts; start = ends[e], e++)
        if (ends[e] < start) return 2;
    const int64_t p = ends[num_experts - 1], col_blocks = n / 32;
    if (p == 0) return 0;
#pragma omp parallel num_threads(num_threads)
    {
        float acc[4][256] __attribute__((aligned(64)));
        const int64_t threads = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t lo = col_blocks * tid / threads, hi = col_blocks * (tid + 1) / threads;
        int tile_rows = 0; /* configured by amx_share */
        for (int64_t e = 0, start = 0; e < num_experts; start = ends[e], e++)
            if (ends[e] > start)
                amx_share(a, lda, start, ends[e], w_packed + e * expert_stride, NULL, out, ldc, k, silu_mul, lo, hi,
                          acc, &tile_rows);
        _tile_release();
    }
    return 0;
}
#else
int amx_init(void) { return -1; }

int gemm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *w_packed, const uint16_t *bias, uint16_t *out,
                  int64_t ldc, int64_t m, int64_t n, int64_t k, int silu_mul, int num_threads) {
    (void)a, (void)lda, (void)w_packed, (void)bias, (void)out, (void)ldc, (void)m, (void)n, (void)k, (void)silu_mul;
    (void)num_threads;
    return 2; /* not built with AMX */
}

int grouped_gemm_bf16_amx(const uint16_t *a, int64_t lda, const uint16_t *w_packed, int64_t expert_stride,
                          const int32_t *ends, int64_t num_experts, uint16_t *out, int64_t ldc, int64_t n, int64_t k,
                          int silu_mul, int num_threads) {
    (void)a, (void)lda, (void)w_packed, (void)expert_stride, (void)ends, (void)num_experts, (void)out, (void)ldc;
    (void)n, (void)k, (void)silu_mul, (void)num_threads;
    return 3; /* not built with AMX */
}
#endif
