/* AVX512-BF16 helpers shared by the kernels: bf16 loads and stores 16 lanes at a time, rounding as
 * torch does, and e^x for x <= 0. Defines VEC_BF16 where the CPU (and -march=native) has them. */
#ifndef PPSERVE_VEC_BF16_H
#define PPSERVE_VEC_BF16_H
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define VEC_BF16 1

/* The first `left` of 16 lanes (all for 16 or more, none for 0 or fewer). */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u));
}

static inline __m512 vload(const uint16_t *p, __mmask16 m) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 -> bf16 with vcvtneps2bf16: rounds to nearest even and quiets NaN exactly as torch does, but
 * reads denormal inputs (magnitude below 1.2e-38) as zero where torch keeps a bf16 denormal. Such values
 * do not occur in activations; checking every vector for them cost 20 % of the SiLU kernel. */
static inline __m256i vround(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

static inline __m512 vwiden(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
static inline __m512 vround_f32(__m512 x) { return vwiden(vround(x)); } /* x rounded to bf16, kept as float */
static inline void vstore(uint16_t *p, __mmask16 m, __m512 x) { _mm256_mask_storeu_epi16(p, m, vround(x)); }

/* e^x for x <= 0 (NaN stays NaN): Cephes' expf reduction and polynomial, within ~1 ulp of libm. Below
 * -88 the result is 0, so that silu(-inf) = -inf * 0 is NaN, as in torch. */
static inline __m512 vexp_nonpos(__m512 x) {
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.f), _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_set1_ps(-88.f), x); /* max returns its second operand when it is NaN */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_scalef_ps((__mmask16)~underflow, p, n);
}

/* silu(g) = g / (1 + e^-g), written as g * s / (1 + s) with s = e^-|g| for negative g (the same value):
 * the denominator stays in [1, 2], so a reciprocal estimate plus one Newton step is accurate to float
 * precision and nothing overflows. */
static inline __m512 vsilu(__m512 g) {
    const __m512 s = vexp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __m512 den = _mm512_add_ps(s, _mm512_set1_ps(1.f));
    __m512 inv = _mm512_rcp14_ps(den);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
    const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, s);
    return _mm512_mul_ps(num, inv);
}
/* silu(gate) * up as torch's eager chain computes it on bf16 tensors: silu rounded to bf16, then the product
 * (which the caller rounds). gate and up hold bf16 values (rounded already where they come from a float
 * accumulator). Shared by the SiLU-and-mul kernel and the GEMMs' gate/up epilogues. */
static inline __m512 vsilu_mul(__m512 gate, __m512 up) { return _mm512_mul_ps(vround_f32(vsilu(gate)), up); }
#endif /* AVX512-BF16 */
#endif /* PPSERVE_VEC_BF16_H */
