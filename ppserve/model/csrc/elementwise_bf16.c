/* Fused bfloat16 element-wise kernels for CPUs: RMSNorm, SiLU(gate) * up and rotary embedding.
 *
 * Each replaces a chain of eager torch ops that each read and write the whole activation (RMSNorm was
 * eight passes: cast, pow, mean, add, rsqrt, mul, cast, mul). Arithmetic follows the torch reference
 * ops: math in float32, rounding to bf16 exactly where the eager chain rounds, so results agree with the
 * torch path to within the rounding of sums. float32 models never come here: their exactness against
 * transformers stays with the eager path. Built and loaded like paged_attention.c (cpu_kernels.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* out[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)); x rows `x_stride` apart, out contiguous. */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t rows,
                   int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * cols;
        float sq = 0.f;
        for (int64_t i = 0; i < cols; i++) {
            const float v = bf16_to_f32(xr[i]);
            sq += v * v;
        }
        const float inv = 1.f / sqrtf(sq / (float)cols + eps);
        for (int64_t i = 0; i < cols; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
    }
}

/* out[r, i] = bf16(silu(gate)) * up for gate_up rows [gate (inter) | up (inter)]. */
void silu_mul_bf16(const uint16_t *gate_up, int64_t gu_stride, uint16_t *out, int64_t rows, int64_t inter,
                   int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * gu_stride, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float gv = bf16_to_f32(g[i]);
            /* e^-g clamped to a finite value: this file is compiled with -ffast-math, which assumes no
             * infinities, and the division by an infinite 1 + e^-g (a gate below -88) came out NaN.
             * Written so that a NaN gate stays NaN (both comparisons false). */
            const float neg = -gv > 88.f ? 88.f : (-gv < -88.f ? -88.f : -gv);
            o[i] = f32_to_bf16(round_bf16(gv / (1.f + expf(neg))) * bf16_to_f32(u[i]));
        }
    }
}

/* Rotate `heads` heads of every token in place ("rotate_half" layout):
 * x[i] <- bf16(bf16(x[i] * cos[i]) + bf16(-x[i + D/2] * sin[i])) for i < D/2, and
 * x[i] <- bf16(bf16(x[i] * cos[i]) + bf16(x[i - D/2] * sin[i])) for i >= D/2.
 * x: token rows `x_stride` apart, heads contiguous within a row; cos/sin [T, D] contiguous bf16. */
void rope_bf16(uint16_t *x, int64_t x_stride, const uint16_t *cos_t, const uint16_t *sin_t, int64_t tokens,
               int64_t heads, int64_t d, int num_threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos_t + t * d, *s = sin_t + t * d;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *xh = x + t * x_stride + h * d;
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
        }
    }
}
