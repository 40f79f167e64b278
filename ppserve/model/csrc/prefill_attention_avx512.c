/* Causal attention for one prefill chunk, bf16, with AVX512-BF16 pair dot products, reading K/V through the
 * block table: the prefill kernel for CPUs that have AVX512-BF16 but no AMX (AMD Zen 4 and later, Intel
 * Cooper Lake). prefill_attention_amx.c is the AMX one; the caller prefers it where AMX is granted.
 *
 * Why: without it a chunk over cached context goes through SDPA after gathering the whole context into a
 * copy, with an explicit mask. On a Zen 4 with a shared 1,024-token prefix (64 questions of 64 tokens),
 * that SDPA ran at ~120 GFLOP/s and was half of the prefill phase's time, beside GEMMs at ~400.
 *
 * The chunk's ql queries sit at positions ctx - ql .. ctx - 1 and see keys 0 .. their own position
 * (bottom-right causal); its own K/V are already in the cache. Head dim 64 only (the caller checks).
 * Work item = (query head, tile of 16 queries), and the 16 vector lanes are the tile's queries, so
 * everything the online softmax does per query (mask, max, rescale, sum) is a vertical vector op:
 *   scores   S^T[key][lane] = sum over dim pairs p of dpbf16(qt[p], broadcast K[key] pair p)
 *            where qt[p][lane] = (q[lane][2p], q[lane][2p+1]): the tile's queries transposed once;
 *   output   O^T[dim][lane] += dpbf16(pp[kk], broadcast (V[2kk][dim], V[2kk+1][dim]))
 *            where pp[kk][lane] = (P[2kk][lane], P[2kk+1][lane]) rounded to bf16.
 * Keys are taken 64 at a time: the chunk's K rows are copied out of their blocks and its V rows
 * interleaved in pairs (a few vector permutes), then each broadcast above is one memory operand. A tile
 * stops at the last key its last query can see. Scores, the softmax and the accumulator are float32, the
 * probabilities rounded to bf16 for P V, as torch's flash attention and the AMX kernel do. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "paged_cache.h"
#include "vec_bf16.h"

#if defined(VEC_BF16)
#define HEAD_DIM 64
#define PAIRS (HEAD_DIM / 2)
#define LANES 16 /* queries per tile */
#define CHUNK 64 /* keys per softmax step */
/* Stands in for -inf (masked scores, the running max before the first key): -ffast-math lets the compiler
 * assume no infinities, and e^(x - max) of it is 0 all the same. */
#define MASKED (-1e30f)

/* s[u][lane] = scale * (q_lane . k_u) for 16 keys whose rows (as dim pairs) are kb[u][0 .. PAIRS). */
static inline void score_block(const uint32_t qt[PAIRS][LANES], const uint32_t kb[16][PAIRS], __m512 vscale,
                               float s[16][LANES]) {
    __m512 acc[16];
    for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
    for (int p = 0; p < PAIRS; p++) {
        const __m512bh qv = (__m512bh)_mm512_load_si512((const void *)qt[p]);
        for (int u = 0; u < 16; u++)
            acc[u] = _mm512_dpbf16_ps(acc[u], qv, (__m512bh)_mm512_set1_epi32((int)kb[u][p]));
    }
    for (int u = 0; u < 16; u++) _mm512_store_ps(s[u], _mm512_mul_ps(acc[u], vscale));
}

/* o^T[16 dims][lane] += sum over the key pairs kk < pairs of P pair kk times V pair kk, for the 16 dims
 * starting at dim0; o is read scaled by alpha (the softmax's rescale) and written back. */
static inline void value_block(const uint32_t pp[CHUNK / 2][LANES], const uint32_t vp[CHUNK / 2][HEAD_DIM],
                               int64_t pairs, int dim0, __m512 alpha, float o[HEAD_DIM][LANES]) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_mul_ps(_mm512_load_ps(o[dim0 + i]), alpha);
    for (int64_t kk = 0; kk < pairs; kk++) {
        const __m512bh pv = (__m512bh)_mm512_load_si512((const void *)pp[kk]);
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], pv, (__m512bh)_mm512_set1_epi32((int)vp[kk][dim0 + i]));
    }
    for (int i = 0; i < 16; i++) _mm512_store_ps(o[dim0 + i], acc[i]);
}

/* Of two 32-dim halves a (even key) and b (odd key), word 2i of the interleave is a[i] (index i) and word
 * 2i + 1 is b[i] (index 32 + i): INTERLEAVE_LO for dims i = 0..15 of the half, INTERLEAVE_HI for 16..31. */
static const uint16_t INTERLEAVE_LO[32] __attribute__((aligned(64))) = {
    0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t INTERLEAVE_HI[32] __attribute__((aligned(64))) = {
    16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* Keys c0 .. c0 + n - 1 of head h into the chunk buffers (n <= CHUNK; the rest of the first `padded` keys
 * zero): kb[t] = K row as dim pairs; vp[kk][dim] = (V[2kk][dim], V[2kk+1][dim]). */
static void load_chunk(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table, int64_t bs,
                       int64_t hkv, int64_t h, int64_t c0, int64_t n, int64_t padded, uint32_t kb[CHUNK][PAIRS],
                       uint32_t vp[CHUNK / 2][HEAD_DIM]) {
    const __m512i lo_idx = _mm512_load_si512((const void *)INTERLEAVE_LO);
    const __m512i hi_idx = _mm512_load_si512((const void *)INTERLEAVE_HI);
    for (int64_t kk = 0; kk < padded / 2; kk++) {
        __m512i v[2][2]; /* [key of the pair][dims 0..31, 32..63] */
        for (int j = 0; j < 2; j++) {
            const int64_t t = 2 * kk + j;
            if (t < n) {
                const uint16_t *vr = cache_row(v_cache, table, c0 + t, bs, hkv, h, HEAD_DIM);
                memcpy(kb[t], cache_row(k_cache, table, c0 + t, bs, hkv, h, HEAD_DIM), HEAD_DIM * 2);
                v[j][0] = _mm512_loadu_si512((const void *)vr);
                v[j][1] = _mm512_loadu_si512((const void *)(vr + 32));
            } else {
                memset(kb[t], 0, HEAD_DIM * 2);
                v[j][0] = v[j][1] = _mm512_setzero_si512();
            }
        }
        const __m512i a = _mm512_permutex2var_epi16(v[0][0], lo_idx, v[1][0]); /* dims 0..15 */
        const __m512i b = _mm512_permutex2var_epi16(v[0][0], hi_idx, v[1][0]); /* dims 16..31 */
        const __m512i c = _mm512_permutex2var_epi16(v[0][1], lo_idx, v[1][1]); /* dims 32..47 */
        const __m512i d = _mm512_permutex2var_epi16(v[0][1], hi_idx, v[1][1]); /* dims 48..63 */
        _mm512_store_si512((void *)&vp[kk][0], a);
        _mm512_store_si512((void *)&vp[kk][16], b);
        _mm512_store_si512((void *)&vp[kk][32], c);
        _mm512_store_si512((void *)&vp[kk][48], d);
    }
}

/* One (query head, tile) work item: rows queries (<= 16) at positions base .. base + rows - 1, whose
 * rows start at q (q_stride elements apart); head h of the caches; output rows out_stride apart. */
static void attend_tile(const uint16_t *q, int64_t q_stride, int64_t rows, int64_t base, const uint16_t *k_cache,
                        const uint16_t *v_cache, const int64_t *table, int64_t bs, int64_t hkv, int64_t h, float scale,
                        uint16_t *out, int64_t out_stride) {
    uint32_t qt[PAIRS][LANES] __attribute__((aligned(64)));
    uint32_t kb[CHUNK][PAIRS] __attribute__((aligned(64)));
    uint32_t vp[CHUNK / 2][HEAD_DIM] __attribute__((aligned(64)));
    uint32_t pp[CHUNK / 2][LANES] __attribute__((aligned(64)));
    float s[CHUNK][LANES] __attribute__((aligned(64)));
    float o[HEAD_DIM][LANES] __attribute__((aligned(64)));
    for (int64_t r = 0; r < LANES; r++) {
        uint32_t row[PAIRS];
        if (r < rows) memcpy(row, q + r * q_stride, sizeof row);
        else memset(row, 0, sizeof row); /* a lane past the tile's rows: finite scores, never stored */
        for (int p = 0; p < PAIRS; p++) qt[p][r] = row[p];
    }
    memset(o, 0, sizeof o);
    const __m512 vscale = _mm512_set1_ps(scale), masked = _mm512_set1_ps(MASKED);
    __m512 run_max = masked, run_sum = _mm512_setzero_ps();
    const int64_t end = base + rows; /* keys 0 .. end - 1: those the tile's last query sees */
    for (int64_t c0 = 0; c0 < end; c0 += CHUNK) {
        const int64_t n = end - c0 < CHUNK ? end - c0 : CHUNK, padded = (n + 15) / 16 * 16;
        load_chunk(k_cache, v_cache, table, bs, hkv, h, c0, n, padded, kb, vp);
        for (int64_t b = 0; b < padded; b += 16) score_block(qt, kb + b, vscale, s + b);
        /* Key c0 + t is hidden from lanes r < c0 + t - base (a later position than theirs); padding keys
         * (t >= n) from every lane. Key 0 is visible to all, so the max is a real score from chunk 0 on. */
        __m512 mx = run_max;
        for (int64_t t = 0; t < padded; t++) {
            const __mmask16 visible = t < n ? (__mmask16)~tail_mask(c0 + t - base) : (__mmask16)0;
            const __m512 sv = _mm512_mask_blend_ps(visible, masked, _mm512_load_ps(s[t]));
            _mm512_store_ps(s[t], sv);
            mx = _mm512_max_ps(mx, sv);
        }
        const __m512 alpha = vexp_nonpos(_mm512_sub_ps(run_max, mx));
        run_max = mx;
        __m512 sum = _mm512_mul_ps(run_sum, alpha);
        for (int64_t kk = 0; kk < padded / 2; kk++) {
            const __m512 p0 = vexp_nonpos(_mm512_sub_ps(_mm512_load_ps(s[2 * kk]), mx));
            const __m512 p1 = vexp_nonpos(_mm512_sub_ps(_mm512_load_ps(s[2 * kk + 1]), mx));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(vround(p0)),
                                              _mm512_slli_epi32(_mm512_cvtepu16_epi32(vround(p1)), 16));
            _mm512_store_si512((void *)pp[kk], w);
        }
        run_sum = sum;
        for (int dim0 = 0; dim0 < HEAD_DIM; dim0 += 16) value_block(pp, vp, padded / 2, dim0, alpha, o);
    }
    float inv[LANES] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), run_sum));
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < HEAD_DIM; c++) out[r * out_stride + c] = f32_to_bf16(o[c][r] * inv[r]);
}

/* q [ql, hq, 64] (token rows q_stride elements apart, heads contiguous); caches [blocks, bs, hkv, 64];
 * table: the sequence's block ids; out [ql, hq, 64] contiguous. Returns 0, 1 = unsupported shape,
 * 3 = not built with AVX512-BF16. */
int prefill_attention_bf16_avx512(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                  const uint16_t *v_cache, const int64_t *table, int64_t ql, int64_t ctx, int64_t hq,
                                  int64_t hkv, int64_t d, int64_t bs, float scale, uint16_t *out, int num_threads) {
    if (d != HEAD_DIM || ql < 1 || ctx < ql || hkv < 1 || hq % hkv) return 1;
    const int64_t tiles = (ql + LANES - 1) / LANES, group = hq / hkv;
    /* Later tiles see more keys: interleaving tiles across threads (static, chunk 1) balances the work. */
#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
    for (int64_t item = 0; item < hq * tiles; item++) {
        const int64_t head = item % hq, tile = tiles - 1 - item / hq; /* longest tiles first */
        const int64_t q0 = tile * LANES, rows = ql - q0 < LANES ? ql - q0 : LANES;
        attend_tile(q + q0 * q_stride + head * HEAD_DIM, q_stride, rows, ctx - ql + q0, k_cache, v_cache, table, bs,
                    hkv, head / group, scale, out + (q0 * hq + head) * HEAD_DIM, hq * HEAD_DIM);
    }
    return 0;
}

int prefill_attention_bf16_avx512_built(void) { return 1; }
#else
int prefill_attention_bf16_avx512(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                  const uint16_t *v_cache, const int64_t *table, int64_t ql, int64_t ctx, int64_t hq,
                                  int64_t hkv, int64_t d, int64_t bs, float scale, uint16_t *out, int num_threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)table, (void)ql, (void)ctx, (void)hq, (void)hkv;
    (void)d, (void)bs, (void)scale, (void)out, (void)num_threads;
    return 3; /* not built with AVX512-BF16 */
}

int prefill_attention_bf16_avx512_built(void) { return 0; }
#endif
