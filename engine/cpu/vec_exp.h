/* exp(x) over a vector of floats, for the softmax and SiLU of the kernels: x = n ln2 + r
   (Cody-Waite, |r| <= ln2 / 2), exp(r) by its Taylor series to r^7 (truncation < 1e-8 relative),
   times 2^n (0 for very negative x, as expf). glibc's vector expf was not used by the compiler,
   and the scalar one made softmax a third of the attention kernel's time. */
#ifndef GS_VEC_EXP_H
#define GS_VEC_EXP_H

#include "isa.h"

#define GS_LOG2E 1.44269504088896341f
#define GS_LN2_HI 0.693145751953125f
#define GS_LN2_LO 1.428606765330187e-06f

#if defined(GS_AVX512)
static inline __m512 gs_exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(GS_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(GS_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(GS_LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(GS_AVX2)
/* 2^n by the exponent bits: n clamped to [-127, 128] first (below -126 the result is 0, the
   polynomial's p < 2 times 2^-127 rounding to a denormal or 0 as expf's does; above 127 inf) */
static inline __m256 gs_exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-104.f));  /* expf underflows to 0 below ~-103.97 */
    x = _mm256_min_ps(x, _mm256_set1_ps(89.f));    /* and overflows above ~88.72 */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(GS_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(GS_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(GS_LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    /* 2^n as two factors 2^(n/2) each within float's normal range: n in [-150, 129] */
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(ni, 1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#endif

#if defined(GS_NEON)
static inline float32x4_t gs_exp4(float32x4_t x) {
    x = vmaxq_f32(x, vdupq_n_f32(-104.f));
    x = vminq_f32(x, vdupq_n_f32(89.f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(GS_LOG2E)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(GS_LN2_HI));
    r = vfmsq_f32(r, n, vdupq_n_f32(GS_LN2_LO));
    float32x4_t p = vdupq_n_f32(1.f / 5040);
    p = vfmaq_f32(vdupq_n_f32(1.f / 720), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f / 120), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f / 24), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f / 6), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
    const int32x4_t ni = vcvtq_s32_f32(n);
    const int32x4_t half = vshrq_n_s32(ni, 1);
    const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, vdupq_n_s32(127)), 23));
    const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vsubq_s32(ni, half), vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(p, s1), s2);
}
#endif

#endif
