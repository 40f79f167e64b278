/* What a mixture-of-experts layer does around its grouped expert matmuls, in three calls: route the tokens,
 * gather their rows by expert, and sum the experts' outputs back per token.
 *
 * moe_dispatch: a token's k routing choices make k (token, expert) pairs, pair p = t * k + j. The pairs are
 * sorted stably by expert (a counting sort: the order torch.sort(stable=True) gives), each pair's token
 * row is copied to its sorted position, and each expert's run ends at ends[e]. pos[p] is pair p's sorted
 * position, the inverse of the sort's order. In torch this was a sort, a searchsorted over an arange, a
 * division and an index_select: five ops and their temporaries for a few hundred bytes of indices. The
 * rows are copied as bytes, so any dtype takes it and the result is the same permutation, bit for bit.
 *
 * moe_route_bf16: the router of a bf16 model: the logits (computed here for small shapes, else given) rounded
 * to bf16 as the bf16 GEMM rounds them, the softmax in float32, the k most probable experts and their
 * probabilities, renormalized or not, as bf16 or float32 weights; eight torch ops and their temporaries
 * before. Exact ties are where this cannot promise torch's answer: torch.topk breaks them by the order its
 * selection algorithm happens to visit, not by a rule. Where two of a row's k + 1 most probable experts have
 * equal logits, the weights are right whichever is chosen, and the kernel names the row for the caller to
 * take its ids from torch.topk over its logits (the same comparisons as over the probabilities); where
 * probabilities come within a few ulps without equal logits (or a logit is NaN) it hands the batch back to
 * the torch chain. Otherwise every row's choice is unique and the same as torch's. Its probabilities come
 * from this file's e^x, within a few float32 ulps of torch's, so a weight may differ from the torch chain's
 * by one bf16 rounding.
 *
 * moe_combine_bf16: the experts' outputs, still in expert order, back to their tokens: each pair's row
 * (read through pos) times its routing weight, and a token's k products summed in top-k order. The
 * arithmetic is that of the torch chain it replaces (index_copy back to pair order, multiply by the
 * weights, sum over k, cast): a bf16 weight rounds each product to bf16 (a bf16 tensor product), a float32
 * weight keeps it in float32; the sum runs in float32 in top-k order and rounds to bf16 once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec_bf16.h"

#define ROUTE_MAX_EXPERTS 1024

/* e^x over n values, all <= 0, in place. */
static void exp_nonpos(float *v, int64_t n) {
#ifdef VEC_BF16
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(v + i, m, vexp_nonpos(_mm512_maskz_loadu_ps(m, v + i)));
    }
#else
    for (int64_t i = 0; i < n; i++) v[i] = expf(v[i]);
#endif
}

/* One token's bf16 logits against the router's float32 weight w [experts, h]: the row is read 16 values at a
 * time, each chunk against 8 experts' weights, eight independent sums. */
static void router_logits(const uint16_t *x, const float *w, int64_t h, int64_t experts, uint16_t *logits) {
#ifdef VEC_BF16
    for (int64_t e0 = 0; e0 < experts; e0 += 8) {
        const int64_t n = experts - e0 < 8 ? experts - e0 : 8;
        __m512 acc[8];
        for (int64_t e = 0; e < 8; e++) acc[e] = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 16) {
            const __mmask16 m = tail_mask(h - i);
            const __m512 xv = vload(x + i, m);
            for (int64_t e = 0; e < n; e++)
                acc[e] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, w + (e0 + e) * h + i), acc[e]);
        }
        for (int64_t e = 0; e < n; e++) logits[e0 + e] = f32_to_bf16(_mm512_reduce_add_ps(acc[e]));
    }
#else
    for (int64_t e = 0; e < experts; e++) {
        float acc = 0.f;
        for (int64_t i = 0; i < h; i++) acc += bf16_to_f32(x[i]) * w[e * h + i];
        logits[e] = f32_to_bf16(acc);
    }
#endif
}

enum { ROUTED = 0, EXACT_TIE = 1, TORCH = 2 };

static int finish_row(const float *top, const int64_t *chosen, const uint16_t *logits, int64_t picks, int64_t k,
                      int normalize, int weights_f32, void *weights, int64_t *ids);

#ifdef VEC_BF16
/* route_row for at most 16 experts, the row in one register: the same arithmetic (the same e^x, the same
 * division), without the scalar loops' branches. */
static int route_row16(const uint16_t *logits, int64_t experts, int64_t k, int normalize, int weights_f32,
                       void *weights, int64_t *ids) {
    const __mmask16 m = tail_mask(experts);
    const __m256i bits = _mm256_maskz_loadu_epi16(m, logits);
    const __mmask16 special = _mm256_mask_cmpeq_epi16_mask(
        m, _mm256_and_si256(bits, _mm256_set1_epi16(0x7f80)), _mm256_set1_epi16(0x7f80));
    if (special) return TORCH; /* NaN or infinity */
    const __m512 l = vwiden(bits);
    const float max = _mm512_mask_reduce_max_ps(m, l);
    __m512 p = _mm512_maskz_mov_ps(m, vexp_nonpos(_mm512_sub_ps(l, _mm512_set1_ps(max))));
    p = _mm512_maskz_div_ps(m, p, _mm512_set1_ps(_mm512_reduce_add_ps(p)));
    /* Lanes past the experts, and chosen ones, hold -1: below every probability. */
    p = _mm512_mask_mov_ps(_mm512_set1_ps(-1.f), m, p);
    float top[17];
    int64_t chosen[17];
    const int64_t picks = k < experts ? k + 1 : k;
    for (int64_t i = 0; i < picks; i++) {
        const float best = _mm512_reduce_max_ps(p);
        const unsigned lane = (unsigned)__builtin_ctz(_mm512_cmp_ps_mask(p, _mm512_set1_ps(best), _CMP_EQ_OQ));
        top[i] = best;
        chosen[i] = lane;
        p = _mm512_mask_mov_ps(p, (__mmask16)(1u << lane), _mm512_set1_ps(-1.f));
    }
    return finish_row(top, chosen, logits, picks, k, normalize, weights_f32, weights, ids);
}
#endif

/* One token's routing from its bf16 logits. Returns ROUTED; EXACT_TIE where two of the k + 1 most probable
 * experts have equal logits (the weights are right whichever of them is chosen, the ids are torch.topk's
 * to give); TORCH where two have distinct logits but probabilities within ~8 ulps (torch's float32 may make
 * them equal) or a logit is NaN or infinite. */
static int route_row(const uint16_t *logits, int64_t experts, int64_t k, int normalize, int weights_f32,
                     void *weights, int64_t *ids) {
#ifdef VEC_BF16
    if (experts <= 16) return route_row16(logits, experts, k, normalize, weights_f32, weights, ids);
#endif
    float p[ROUTE_MAX_EXPERTS];
    float top[ROUTE_MAX_EXPERTS + 1];
    int64_t chosen[ROUTE_MAX_EXPERTS + 1];
    float max = bf16_to_f32(logits[0]);
    for (int64_t e = 0; e < experts; e++) {
        if ((logits[e] & 0x7f80u) == 0x7f80u) return TORCH; /* NaN or infinity (by bits: -ffast-math) */
        p[e] = bf16_to_f32(logits[e]);
        if (p[e] > max) max = p[e];
    }
    for (int64_t e = 0; e < experts; e++) p[e] -= max;
    exp_nonpos(p, experts);
    float sum = 0.f;
    for (int64_t e = 0; e < experts; e++) sum += p[e];
    for (int64_t e = 0; e < experts; e++) p[e] /= sum;
    /* The k + 1 largest in one pass, kept in descending order by insertion: most experts fall below the
     * smallest kept and cost one comparison (k passes over 128 experts cost more than torch's chain). An
     * expert goes after the kept ones it equals, so ties keep the lower index first. */
    const int64_t picks = k < experts ? k + 1 : k;
    int64_t kept = 0;
    for (int64_t e = 0; e < experts; e++) {
        if (kept == picks && !(p[e] > top[picks - 1])) continue;
        int64_t i = kept < picks ? kept++ : picks - 1;
        for (; i > 0 && p[e] > top[i - 1]; i--) {
            top[i] = top[i - 1];
            chosen[i] = chosen[i - 1];
        }
        top[i] = p[e];
        chosen[i] = e;
    }
    return finish_row(top, chosen, logits, picks, k, normalize, weights_f32, weights, ids);
}

/* From the k + 1 (or k, where that is all) largest probabilities in order and their experts: the status
 * (see route_row) and, unless TORCH, the ids and weights. */
static int finish_row(const float *top, const int64_t *chosen, const uint16_t *logits, int64_t picks, int64_t k,
                      int normalize, int weights_f32, void *weights, int64_t *ids) {
    int status = ROUTED;
    for (int64_t i = 0; i + 1 < picks; i++) {
        if (logits[chosen[i]] == logits[chosen[i + 1]]) status = EXACT_TIE;
        else if (top[i] - top[i + 1] <= top[i] * 1e-6f) return TORCH;
    }
    float norm = 0.f;
    for (int64_t i = 0; i < k; i++) norm += top[i];
    for (int64_t i = 0; i < k; i++) {
        const float v = normalize ? top[i] / norm : top[i];
        ids[i] = chosen[i];
        if (weights_f32) ((float *)weights)[i] = v;
        else ((uint16_t *)weights)[i] = f32_to_bf16(v);
    }
    return status;
}

/* x [tokens, h] bf16 (row stride x_stride) against the router's float32 weight w [experts, h] into bf16
 * logits [tokens, experts]; or x NULL: the logits are given. Then ids [tokens, k] and weights [tokens, k]
 * (float32 where weights_f32, else bf16). Returns how many rows hold an exact tie (route_row's EXACT_TIE),
 * their indices in `tied_rows` in order, for the caller to take their ids from torch.topk over their
 * logits; -2 where some row is torch's to route whole (TORCH: the caller routes every row from the
 * logits, which are complete either way); -1 for more experts than the kernel holds, or no memory. */
int64_t moe_route_bf16(const uint16_t *x, int64_t x_stride, const float *w, uint16_t *logits, int64_t tokens,
                       int64_t h, int64_t experts, int64_t k, int normalize, int weights_f32, void *weights,
                       int64_t *ids, int64_t *tied_rows, int nthreads) {
    if (experts > ROUTE_MAX_EXPERTS || k > experts || k < 1) return -1;
    const int64_t wsize = weights_f32 ? 4 : 2;
    char *status = malloc((size_t)tokens + 1);
    if (!status) return -1;
    int worst = ROUTED;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tokens * experts * (h + 64) >= (1 << 20)) \
    reduction(max : worst)
    for (int64_t t = 0; t < tokens; t++) {
        if (x) router_logits(x + t * x_stride, w, h, experts, logits + t * experts);
        status[t] = (char)route_row(logits + t * experts, experts, k, normalize, weights_f32,
                                    (char *)weights + t * k * wsize, ids + t * k);
        if (status[t] > worst) worst = status[t];
    }
    int64_t tied = 0;
    if (worst == EXACT_TIE)
        for (int64_t t = 0; t < tokens; t++)
            if (status[t] == EXACT_TIE) tied_rows[tied++] = t;
    free(status);
    return worst == TORCH ? -2 : tied;
}

/* Returns 0, or 1 where an expert id is outside [0, experts), 2 where memory ran out. */
int moe_dispatch(const char *x, int64_t x_stride_bytes, const int64_t *ids, int64_t tokens, int64_t k,
                 int64_t experts, int64_t row_bytes, char *rows, int64_t *pos, int32_t *ends, int nthreads) {
    const int64_t pairs = tokens * k;
    int64_t *next = calloc((size_t)experts, sizeof *next);
    if (!next) return 2;
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t e = ids[p];
        if (e < 0 || e >= experts) {
            free(next);
            return 1;
        }
        next[e]++;
    }
    int64_t run = 0;
    for (int64_t e = 0; e < experts; e++) { /* next[e]: where expert e's run starts */
        const int64_t count = next[e];
        next[e] = run;
        run += count;
        ends[e] = (int32_t)run;
    }
    for (int64_t p = 0; p < pairs; p++) pos[p] = next[ids[p]]++; /* in pair order: a stable sort */
    free(next);
    /* A prefill chunk's gather is megabytes; a decode step's a few kilobytes, not worth waking threads. */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (pairs * row_bytes >= (1 << 18))
    for (int64_t p = 0; p < pairs; p++)
        memcpy(rows + pos[p] * row_bytes, x + (p / k) * x_stride_bytes, (size_t)row_bytes);
    return 0;
}

/* Pair (t, j)'s routing weight as a float. */
static inline float routing_weight(const void *weights, int weights_f32, int64_t i) {
    return weights_f32 ? ((const float *)weights)[i] : bf16_to_f32(((const uint16_t *)weights)[i]);
}

#ifdef VEC_BF16
static void combine_token(const uint16_t *down, const int64_t *pos, const void *weights, int weights_f32,
                          int64_t t, int64_t k, int64_t h, uint16_t *o) {
    for (int64_t c = 0; c < h; c += 16) {
        const __mmask16 m = tail_mask(h - c);
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j++) {
            const __m512 w = _mm512_set1_ps(routing_weight(weights, weights_f32, t * k + j));
            __m512 prod = _mm512_mul_ps(vload(down + pos[t * k + j] * h + c, m), w);
            if (!weights_f32) prod = vround_f32(prod);
            acc = j == 0 ? prod : _mm512_add_ps(acc, prod);
        }
        vstore(o + c, m, acc);
    }
}
#else
/* The reference loop. No contraction of the product into an FMA with the add (that would skip the
 * product's rounding) and no reassociation of the chain, whatever -ffast-math allows elsewhere. */
__attribute__((optimize("fp-contract=off", "no-associative-math")))
static void combine_token(const uint16_t *down, const int64_t *pos, const void *weights, int weights_f32,
                          int64_t t, int64_t k, int64_t h, uint16_t *o) {
    for (int64_t c = 0; c < h; c++) {
        float acc = 0.f;
        for (int64_t j = 0; j < k; j++) {
            float prod = bf16_to_f32(down[pos[t * k + j] * h + c]) * routing_weight(weights, weights_f32, t * k + j);
            if (!weights_f32) prod = bf16_to_f32(f32_to_bf16(prod));
            acc = j == 0 ? prod : acc + prod;
        }
        o[c] = f32_to_bf16(acc);
    }
}
#endif

/* out[t] = bf16(sum_j product(down[pos[t k + j]], weights[t, j])) over j in top-k order; weights bf16
 * (weights_f32 == 0) or float32. */
void moe_combine_bf16(const uint16_t *down, const int64_t *pos, const void *weights, int weights_f32,
                      int64_t tokens, int64_t k, int64_t h, uint16_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tokens * h >= (1 << 16))
    for (int64_t t = 0; t < tokens; t++) combine_token(down, pos, weights, weights_f32, t, k, h, out + t * h);
}
