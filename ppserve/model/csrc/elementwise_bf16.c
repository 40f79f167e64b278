/* Fused bfloat16 element-wise kernels for CPUs: RMSNorm (optionally fused with the residual add),
 * SiLU(gate) * up, rotary embedding, and Qwen3's per-head q/k norm with the rotation after it.
 *
 * Each replaces a chain of eager torch ops that each read and write the whole activation (RMSNorm was
 * eight passes: cast, pow, mean, add, rsqrt, mul, cast, mul). Arithmetic follows the torch reference
 * ops: math in float32, rounding to bf16 exactly where the eager chain rounds, so results agree with the
 * torch path to within the rounding of sums. float32 models never come here: their exactness against
 * transformers stays with the eager path. Built and loaded like paged_attention.c (ops/build.py, ops/native.py).
 *
 * Every kernel works one row at a time. With AVX512-BF16 a row is processed 16 floats per instruction
 * with explicit intrinsics: the auto-vectorised scalar code spent ~4 cycles per element on integer
 * rounding sequences, register spills around libmvec's expf and 256-bit splits. Elsewhere the scalar
 * loops (the reference semantics) run.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* e^-g clamped to a finite value: this file is compiled with -ffast-math, which assumes no infinities,
 * and the division by an infinite 1 + e^-g (a gate below -88) came out NaN. Written so that a NaN gate
 * stays NaN (both comparisons false). */
static inline float silu_scalar(float g) {
    const float neg = -g > 88.f ? 88.f : (-g < -88.f ? -88.f : -g);
    return g / (1.f + expf(neg));
}

#include "vec_bf16.h"

/* o = w * bf16(r * rsqrt(mean(r^2) + eps)) for one row r of `cols` values. */
static void norm_row(const uint16_t *r, const uint16_t *w, uint16_t *o, int64_t cols, float eps) {
#ifdef VEC_BF16
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < cols; i += 16) {
        const __m512 v = vload(r + i, tail_mask(cols - i));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)cols + eps));
    for (int64_t i = 0; i < cols; i += 16) {
        const __mmask16 m = tail_mask(cols - i);
        vstore(o + i, m, _mm512_mul_ps(vload(w + i, m), vround_f32(_mm512_mul_ps(vload(r + i, m), inv))));
    }
#else
    float sq = 0.f;
    for (int64_t i = 0; i < cols; i++) {
        const float v = bf16_to_f32(r[i]);
        sq += v * v;
    }
    const float inv = 1.f / sqrtf(sq / (float)cols + eps);
    for (int64_t i = 0; i < cols; i++)
        o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(r[i]) * inv));
#endif
}

/* out[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)); x rows `x_stride` apart, out contiguous. */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t rows,
                   int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, w, out + r * cols, cols, eps);
}

/* The residual add fused with the norm that follows it (one pass over the activations instead of two):
 * total[r] = bf16(x[r] + y[r]), out[r] = RMSNorm(total[r]). All contiguous; total may alias x. */
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *y, const uint16_t *w, uint16_t *total, uint16_t *out,
                       int64_t rows, int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * cols, *yr = y + r * cols;
        uint16_t *tr = total + r * cols;
#ifdef VEC_BF16
        for (int64_t i = 0; i < cols; i += 16) {
            const __mmask16 m = tail_mask(cols - i);
            vstore(tr + i, m, _mm512_add_ps(vload(xr + i, m), vload(yr + i, m)));
        }
#else
        for (int64_t i = 0; i < cols; i++) tr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(yr[i]));
#endif
        norm_row(tr, w, out + r * cols, cols, eps);
    }
}

/* out[r, i] = bf16(silu(gate)) * up for gate_up rows [gate (inter) | up (inter)]. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t gu_stride, uint16_t *out, int64_t rows, int64_t inter,
                   int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * gu_stride, *u = g + inter;
        uint16_t *o = out + r * inter;
#ifdef VEC_BF16
        for (int64_t i = 0; i < inter; i += 16) {
            const __mmask16 m = tail_mask(inter - i);
            vstore(o + i, m, vsilu_mul(vload(g + i, m), vload(u + i, m)));
        }
#else
        for (int64_t i = 0; i < inter; i++) o[i] = f32_to_bf16(round_bf16(silu_scalar(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
#endif
    }
}

/* Rotate one head of d values in place ("rotate_half" layout):
 * x[i] <- bf16(bf16(x[i] * cos[i]) + bf16(-x[i + D/2] * sin[i])) for i < D/2, and
 * x[i] <- bf16(bf16(x[i] * cos[i]) + bf16(x[i - D/2] * sin[i])) for i >= D/2. */
static void rope_head(uint16_t *xh, const uint16_t *c, const uint16_t *s, int64_t d) {
    const int64_t half = d / 2;
#ifdef VEC_BF16
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 lo = vload(xh + i, m), hi = vload(xh + half + i, m);
        const __m512 c_lo = vload(c + i, m), c_hi = vload(c + half + i, m);
        const __m512 s_lo = vload(s + i, m), s_hi = vload(s + half + i, m);
        const __m512 neg_hi = _mm512_xor_ps(hi, _mm512_set1_ps(-0.f)); /* exact negation, like torch's */
        vstore(xh + i, m, _mm512_add_ps(vround_f32(_mm512_mul_ps(lo, c_lo)), vround_f32(_mm512_mul_ps(neg_hi, s_lo))));
        vstore(xh + half + i, m, _mm512_add_ps(vround_f32(_mm512_mul_ps(hi, c_hi)), vround_f32(_mm512_mul_ps(lo, s_hi))));
    }
#else
    float lo[512], hi[512];
    for (int64_t i = 0; i < half; i++) {
        lo[i] = bf16_to_f32(xh[i]);
        hi[i] = bf16_to_f32(xh[i + half]);
    }
    for (int64_t i = 0; i < half; i++) {
        xh[i] = f32_to_bf16(round_bf16(lo[i] * bf16_to_f32(c[i])) + round_bf16(-hi[i] * bf16_to_f32(s[i])));
        xh[i + half] = f32_to_bf16(round_bf16(hi[i] * bf16_to_f32(c[i + half])) +
                                   round_bf16(lo[i] * bf16_to_f32(s[i + half])));
    }
#endif
}

/* Rotate `heads` heads of every token in place. x: token rows `x_stride` apart, heads contiguous within
 * a row; cos/sin [T, D] contiguous bf16. */
void rope_bf16(uint16_t *x, int64_t x_stride, const uint16_t *cos_t, const uint16_t *sin_t, int64_t tokens,
               int64_t heads, int64_t d, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) rope_head(x + t * x_stride + h * d, cos_t + t * d, sin_t + t * d, d);
}

/* Qwen3's query and key heads: each head through its RMSNorm (q_w for the first q_heads heads of a token,
 * k_w for the k_heads after them), then rotated, all in place: what rms_norm_bf16 per head and then
 * rope_bf16 compute, bit for bit, in one call instead of the chain of ops a small model's decode step
 * pays for per call. x: token rows `x_stride` apart, heads contiguous within a row. */
void qk_norm_rope_bf16(uint16_t *x, int64_t x_stride, const uint16_t *q_w, const uint16_t *k_w,
                       const uint16_t *cos_t, const uint16_t *sin_t, int64_t tokens, int64_t q_heads,
                       int64_t k_heads, int64_t d, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < q_heads + k_heads; h++) {
            uint16_t *xh = x + t * x_stride + h * d;
            norm_row(xh, h < q_heads ? q_w : k_w, xh, d, eps); /* in place: each value is read before written */
            rope_head(xh, cos_t + t * d, sin_t + t * d, d);
        }
}
