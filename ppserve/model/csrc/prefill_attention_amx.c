/* Causal attention for one prefill chunk, bf16, on AMX tiles, reading K/V through the block table.
 *
 * Why: torch's CPU flash attention was the largest single cost of a mixed step after the GEMMs (~2.9 ms a
 * layer for a 486-token chunk over ~800 tokens of context), and with its 512-key blocks it computes every
 * masked score of a first chunk. Here a 16-query tile stops at the last 64-key chunk its last query can
 * see, and K/V are read in place from the paged cache instead of being gathered into a copy first.
 *
 * The chunk's ql queries sit at positions ctx - ql .. ctx - 1 and see keys 0 .. their own position
 * (bottom-right causal); its own K/V are already in the cache. Head dim 64 only (the caller checks).
 * Per KV head, K and V are first rearranged into AMX's B-tile layout (pairs interleaved along the
 * reduction dimension), zero-padded to a multiple of 64 keys:
 *   kt[h][g16][dh][kk][n][2] = K[16 g16 + n][32 dh + 2 kk + {0, 1}]   (S = Q K^T, reduce over dims)
 *   vt[h][g32][dh][kk][n][2] = V[32 g32 + 2 kk + {0, 1}][16 dh + n]   (O = P V, reduce over keys)
 * Then every (query head, 16-query tile) is one work item: online softmax over 64-key chunks, scores
 * and the output accumulator in float32, probabilities rounded to bf16 for the P V product (as torch's
 * flash attention does). Tiles: 0-1 Q, 2-5 scores and then P V, 6 B operand, 7 P. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "paged_cache.h"
#include "vec_bf16.h"

#if defined(HAVE_AMX) && defined(VEC_BF16)
#define HEAD_DIM 64
#define KEYS_PER_GROUP 32 /* keys per rearranged group (one B tile of V) */
#define CHUNK 64          /* keys per softmax step */
#define TILE_ELEMS 512 /* bf16 per 16 x 64-byte tile */

static void rearrange_kv(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table, int64_t ctx,
                         int64_t padded, int64_t bs, int64_t hkv, uint16_t *kt, uint16_t *vt, int num_threads) {
    const int64_t per_head = padded * HEAD_DIM;
#pragma omp parallel for collapse(2) num_threads(num_threads) schedule(static)
    for (int64_t h = 0; h < hkv; h++) {
        for (int64_t g = 0; g < padded / KEYS_PER_GROUP; g++) {
            uint32_t *kh = (uint32_t *)(kt + h * per_head + g * 2 * 2 * TILE_ELEMS); /* 2 x g16, 2 x dh */
            uint16_t *vh = vt + h * per_head + g * 4 * TILE_ELEMS;                    /* 4 x dh */
            for (int64_t j = 0; j < KEYS_PER_GROUP; j++) {
                const int64_t t = g * KEYS_PER_GROUP + j;
                uint32_t krow[HEAD_DIM / 2];
                uint16_t vrow[HEAD_DIM];
                if (t < ctx) {
                    memcpy(krow, cache_row(k_cache, table, t, bs, hkv, h, HEAD_DIM), sizeof krow);
                    memcpy(vrow, cache_row(v_cache, table, t, bs, hkv, h, HEAD_DIM), sizeof vrow);
                } else {
                    memset(krow, 0, sizeof krow);
                    memset(vrow, 0, sizeof vrow);
                }
                /* K: key j of this 32-chunk is column n = j % 16 of 16-key group j / 16; dim pair p goes to
                 * tile dh = p / 16, row kk = p % 16. */
                uint32_t *kg = kh + (j / 16) * 2 * 256;
                for (int64_t p = 0; p < HEAD_DIM / 2; p++) kg[(p / 16) * 256 + (p % 16) * 16 + (j % 16)] = krow[p];
                /* V: key j is half j % 2 of pair row kk = j / 2; dim c goes to tile c / 16, column c % 16. */
                for (int64_t c = 0; c < HEAD_DIM; c++)
                    vh[(c / 16) * TILE_ELEMS + (j / 2) * 32 + (c % 16) * 2 + (j % 2)] = vrow[c];
            }
        }
    }
}

/* One (query head, 16-query tile) work item, over chunks of 64 keys: per chunk, the scores are 4 tiles
 * (16 keys each) and P V accumulates in the same 4 tiles (16 dims each), so the softmax bookkeeping per
 * row (max, rescale, accumulator update) is paid once per 64 keys. */
static void attend_tile(const uint16_t *q, int64_t q_stride, int64_t q0, int64_t rows, int64_t first_pos,
                        const uint16_t *kt, const uint16_t *vt, float scale, uint16_t *out, int64_t out_stride) {
    uint16_t qbuf[16 * HEAD_DIM] __attribute__((aligned(64)));
    uint16_t pbuf[16 * CHUNK] __attribute__((aligned(64)));
    float sbuf[16 * CHUNK] __attribute__((aligned(64))); /* scores, then P V */
    float acc[16][HEAD_DIM] __attribute__((aligned(64)));
    float row_max[16];
    __m512 row_sum[16]; /* lane-wise partial sums, reduced once at the end */
    for (int64_t r = 0; r < 16; r++) {
        if (r < rows) memcpy(qbuf + r * HEAD_DIM, q + (q0 + r) * q_stride, HEAD_DIM * 2);
        else memset(qbuf + r * HEAD_DIM, 0, HEAD_DIM * 2);
        row_max[r] = -INFINITY, row_sum[r] = _mm512_setzero_ps();
        memset(acc[r], 0, sizeof acc[r]);
    }
    _tile_loadd(0, qbuf, HEAD_DIM * 2);
    _tile_loadd(1, qbuf + 32, HEAD_DIM * 2);
    const int64_t last_pos = first_pos + q0 + rows - 1; /* the tile's last query sees keys 0 .. last_pos */
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c <= last_pos / CHUNK; c++) {
        const uint16_t *kc = kt + c * 8 * TILE_ELEMS, *vc = vt + c * 8 * TILE_ELEMS;
        /* S: tile 2 + g holds keys 16 g .. 16 g + 15; K tile (2 g + dh) covers dims 32 dh .. 32 dh + 31. */
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
#define SCORES(g, C)                                             \
        _tile_loadd(6, kc + (2 * (g)) * TILE_ELEMS, 64);         \
        _tile_dpbf16ps(C, 0, 6);                                 \
        _tile_loadd(6, kc + (2 * (g) + 1) * TILE_ELEMS, 64);     \
        _tile_dpbf16ps(C, 1, 6);
        SCORES(0, 2)
        SCORES(1, 3)
        SCORES(2, 4)
        SCORES(3, 5)
#undef SCORES
        _tile_stored(2, sbuf, CHUNK * 4);
        _tile_stored(3, sbuf + 16, CHUNK * 4);
        _tile_stored(4, sbuf + 32, CHUNK * 4);
        _tile_stored(5, sbuf + 48, CHUNK * 4);
        for (int64_t r = 0; r < 16; r++) {
            uint16_t *p = pbuf + r * CHUNK;
            if (r >= rows) {
                memset(p, 0, CHUNK * 2);
                continue;
            }
            /* Keys after this query's position are masked; key 0 is always visible, so the running max
             * is finite from the first chunk on. */
            const int64_t visible = first_pos + q0 + r - c * CHUNK + 1;
            __m512 sv[4];
            __m512 mx = ninf;
            for (int v = 0; v < 4; v++) {
                sv[v] = _mm512_mask_mul_ps(ninf, tail_mask(visible - 16 * v), _mm512_load_ps(sbuf + r * CHUNK + 16 * v), vscale);
                mx = _mm512_max_ps(mx, sv[v]);
            }
            const float chunk_max = _mm512_reduce_max_ps(mx);
            const float new_max = chunk_max > row_max[r] ? chunk_max : row_max[r];
            /* (-ffast-math: no expf(-inf); the first chunk has nothing to rescale) */
            const float alpha = row_max[r] == -INFINITY ? 0.f : expf(row_max[r] - new_max);
            row_max[r] = new_max;
            const __m512 vmax = _mm512_set1_ps(new_max);
            __m512 sum = _mm512_mul_ps(row_sum[r], _mm512_set1_ps(alpha));
            for (int v = 0; v < 4; v++) {
                const __m512 pv = vexp_nonpos(_mm512_sub_ps(sv[v], vmax));
                sum = _mm512_add_ps(sum, pv);
                _mm256_store_si256((__m256i *)(p + 16 * v), vround(pv));
            }
            row_sum[r] = sum;
            if (alpha != 1.f) {
                const __m512 va = _mm512_set1_ps(alpha);
                for (int64_t i = 0; i < HEAD_DIM; i += 16) _mm512_store_ps(acc[r] + i, _mm512_mul_ps(_mm512_load_ps(acc[r] + i), va));
            }
        }
        /* P V: tile 2 + dh accumulates dims 16 dh .. 16 dh + 15 over both 32-key halves of the chunk. */
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t half = 0; half < 2; half++) {
            const uint16_t *vh = vc + half * 4 * TILE_ELEMS;
            _tile_loadd(7, pbuf + half * 32, CHUNK * 2);
            _tile_loadd(6, vh, 64);
            _tile_dpbf16ps(2, 7, 6);
            _tile_loadd(6, vh + TILE_ELEMS, 64);
            _tile_dpbf16ps(3, 7, 6);
            _tile_loadd(6, vh + 2 * TILE_ELEMS, 64);
            _tile_dpbf16ps(4, 7, 6);
            _tile_loadd(6, vh + 3 * TILE_ELEMS, 64);
            _tile_dpbf16ps(5, 7, 6);
        }
        _tile_stored(2, sbuf, CHUNK * 4);
        _tile_stored(3, sbuf + 16, CHUNK * 4);
        _tile_stored(4, sbuf + 32, CHUNK * 4);
        _tile_stored(5, sbuf + 48, CHUNK * 4);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < HEAD_DIM; i += 16)
                _mm512_store_ps(acc[r] + i, _mm512_add_ps(_mm512_load_ps(acc[r] + i), _mm512_load_ps(sbuf + r * CHUNK + i)));
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(row_sum[r]));
        for (int64_t i = 0; i < HEAD_DIM; i += 16)
            vstore(out + (q0 + r) * out_stride + i, 0xffff, _mm512_mul_ps(_mm512_load_ps(acc[r] + i), inv));
    }
}

/* q [ql, hq, 64] (token rows q_stride elements apart, heads contiguous); caches [blocks, bs, hkv, 64];
 * table: the sequence's block ids; out [ql, hq, 64] contiguous. Returns 0, 1 = unsupported shape,
 * 2 = out of memory. */
int prefill_attention_bf16_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int64_t *table, int64_t ql, int64_t ctx, int64_t hq, int64_t hkv, int64_t d,
                               int64_t bs, float scale, uint16_t *out, int num_threads) {
    if (d != HEAD_DIM || ql < 1 || ctx < ql || hkv < 1 || hq % hkv) return 1;
    const int64_t padded = (ctx + CHUNK - 1) / CHUNK * CHUNK;
    uint16_t *kt = aligned_alloc(64, (size_t)(2 * hkv * padded * HEAD_DIM * 2));
    if (kt == NULL) return 2;
    uint16_t *vt = kt + hkv * padded * HEAD_DIM;
    rearrange_kv(k_cache, v_cache, table, ctx, padded, bs, hkv, kt, vt, num_threads);
    const int64_t tiles = (ql + 15) / 16, group = hq / hkv;
    /* Later tiles see more keys: interleaving tiles across threads (static, chunk 1) balances the work. */
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
#pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < hq * tiles; item++) {
            const int64_t head = item % hq, tile = tiles - 1 - item / hq; /* longest tiles first */
            const int64_t h = head / group;
            attend_tile(q + head * HEAD_DIM, q_stride, tile * 16, ql - tile * 16 < 16 ? ql - tile * 16 : 16, ctx - ql,
                        kt + h * padded * HEAD_DIM, vt + h * padded * HEAD_DIM, scale, out + head * HEAD_DIM, hq * HEAD_DIM);
        }
        _tile_release();
    }
    free(kt);
    return 0;
}
#else
int prefill_attention_bf16_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int64_t *table, int64_t ql, int64_t ctx, int64_t hq, int64_t hkv, int64_t d,
                               int64_t bs, float scale, uint16_t *out, int num_threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)table, (void)ql, (void)ctx, (void)hq, (void)hkv;
    (void)d, (void)bs, (void)scale, (void)out, (void)num_threads;
    return 3; /* not built with AMX */
}
#endif
