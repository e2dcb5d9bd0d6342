/* quant_linear.c's panel block on AVX-512 VNNI: rows (<= 16) x 16 outputs of one panel, one float
   accumulator register per row; per block and row, 8 vpdpbusd into an int32 sum, then one scaled add
   (two with mins, two halves for Q6_K) */
static inline __attribute__((always_inline)) __m512 load_scales(const int t, const uint8_t* p) {
    return (t == Q4_K || t == Q6_K) ? _mm512_loadu_ps(p) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
static inline __attribute__((always_inline)) __m512i bcast4(const int8_t* p) {
    int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v);
}
static inline __attribute__((always_inline)) void block(const int t, const int rows, const int8_t* xq,
        int64_t k, const float* dx, const int32_t* sx, int64_t nb, const uint8_t* panel,
        const float* bias, float* out, int64_t ldo, int64_t valid) {
    const uint8_t* qs = panel;
    const uint8_t* sc = qs + nb * quant_bytes(t);
    const uint8_t* mn = sc + nb * scale_bytes(t);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MAX_ROWS];
    #pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* q = qs + b * quant_bytes(t);
        __m512i w[8];
        if (t == Q8_0 || t == Q6_K) {
            #pragma GCC unroll 8
            for (int g = 0; g < 8; ++g) {
                _mm_prefetch((const char*)(q + PREFETCH + 64 * g), _MM_HINT_T0);
                w[g] = _mm512_load_si512((const void*)(q + 64 * g));
            }
        } else {
            #pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                _mm_prefetch((const char*)(q + PREFETCH + 64 * c), _MM_HINT_T0);
                const __m512i v = _mm512_load_si512((const void*)(q + 64 * c));
                w[c] = _mm512_and_si512(v, low);
                w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        const __m512 d = load_scales(t, sc + b * scale_bytes(t));
        const __m512 d2 = t == Q6_K ? _mm512_loadu_ps(sc + b * scale_bytes(t) + 64) : d;
        const __m512 mw = min_bytes(t) ? load_scales(t, mn + b * min_bytes(t)) : d;
        #pragma GCC unroll 16
        for (int m = 0; m < rows; ++m) {
            const int8_t* xb = xq + m * k + b * QK;
            const int64_t i = m * nb + b;
            const float dxm = dx[i];
            if (t == Q6_K) {  /* a scale per half block */
                __m512i s0 = _mm512_set1_epi32(-offset(t) * sx[2 * i]);
                __m512i s1 = _mm512_set1_epi32(-offset(t) * sx[2 * i + 1]);
                #pragma GCC unroll 4
                for (int g = 0; g < 4; ++g) {
                    s0 = _mm512_dpbusd_epi32(s0, w[g], bcast4(xb + 4 * g));
                    s1 = _mm512_dpbusd_epi32(s1, w[g + 4], bcast4(xb + 16 + 4 * g));
                }
                const __m512 x = _mm512_set1_ps(dxm);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d, x), acc[m]);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d2, x), acc[m]);
                continue;
            }
            __m512i s = _mm512_set1_epi32(-offset(t) * (sx[2 * i] + sx[2 * i + 1]));
            #pragma GCC unroll 8
            for (int g = 0; g < 8; ++g) s = _mm512_dpbusd_epi32(s, w[g], bcast4(xb + 4 * g));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dxm)), acc[m]);
            if (min_bytes(t))
                acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dxm * (float)(sx[2 * i] + sx[2 * i + 1])), acc[m]);
        }
    }
    const __mmask16 mask = valid >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) _mm512_mask_storeu_ps(out + m * ldo, mask, _mm512_add_ps(acc[m], bv));
}
#define GS_QUANT_PATH "AVX-512 VNNI"
