/* Scalar bfloat16 <-> float conversions shared by the kernels, rounding exactly as torch does (to
 * nearest even; a NaN stays a NaN). The 16-lane AVX512-BF16 versions are in vec_bf16.h. */
#ifndef PPSERVE_BF16_H
#define PPSERVE_BF16_H
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
#endif
