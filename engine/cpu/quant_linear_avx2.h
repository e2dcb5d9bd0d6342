/* quant_linear.c's panel block on 256-bit registers: AVX-VNNI's vpdpbusd where the CPU has it,
   else AVX2's vpmaddubsw + vpmaddwd; the same arithmetic as the AVX-512 block (same layout, same
   exact int32 block sums), in two passes of 8 outputs */
static inline __attribute__((always_inline)) __m256 load_scales(const int t, const uint8_t* p) {
    return (t == Q4_K || t == Q6_K) ? _mm256_loadu_ps((const float*)p) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
static inline __attribute__((always_inline)) __m256i bcast4(const int8_t* p) {
    int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v);
}
#if defined(GS_AVX_VNNI)
#define SIGNED_Q8 0
static inline __attribute__((always_inline)) __m256i dot4(const int t, __m256i s, __m256i w, __m256i x) {
    (void)t; return _mm256_dpbusd_avx_epi32(s, w, x);
}
#define GS_QUANT_PATH "AVX-VNNI"
#else
/* vpdpbusd from vpmaddubsw (pairs, saturating at int16) and vpmaddwd: 4- and 6-bit quants stay below
   the bound (63 * 127 * 2); 8-bit ones are taken signed, |w| times x with w's sign (128 * 127 * 2) */
#define SIGNED_Q8 1
static inline __attribute__((always_inline)) __m256i dot4(const int t, __m256i s, __m256i w, __m256i x) {
    __m256i p;
    if (t == Q8_0) {
        const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        p = _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws));
    } else {
        p = _mm256_maddubs_epi16(w, x);
    }
    return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#define GS_QUANT_PATH "AVX2"
#endif
/* as the AVX-512 block, in two passes of 8 outputs (each the half of every 64 bytes that is theirs) */
static inline __attribute__((always_inline)) void block(const int t, const int rows, const int8_t* xq,
        int64_t k, const float* dx, const int32_t* sx, int64_t nb, const uint8_t* panel,
        const float* bias, float* out, int64_t ldo, int64_t valid) {
    const uint8_t* qs = panel;
    const uint8_t* sc = qs + nb * quant_bytes(t);
    const uint8_t* mn = sc + nb * scale_bytes(t);
    const int64_t half_scales = (t == Q4_K || t == Q6_K) ? 32 : 16;  /* bytes of 8 rows' scales */
    const int32_t off = (t == Q8_0 && SIGNED_Q8) ? 0 : offset(t);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2 && 8 * h < valid; ++h) {
        __m256 acc[MAX_ROWS];
        #pragma GCC unroll 16
        for (int m = 0; m < rows; ++m) acc[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* q = qs + b * quant_bytes(t) + 32 * h;
            __m256i w[8];
            if (t == Q8_0 || t == Q6_K) {
                #pragma GCC unroll 8
                for (int g = 0; g < 8; ++g) {
                    if (h == 0) _mm_prefetch((const char*)(q + PREFETCH + 64 * g), _MM_HINT_T0);
                    w[g] = _mm256_load_si256((const __m256i*)(q + 64 * g));
                }
            } else {
                #pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) {
                    if (h == 0) _mm_prefetch((const char*)(q + PREFETCH + 64 * c), _MM_HINT_T0);
                    const __m256i v = _mm256_load_si256((const __m256i*)(q + 64 * c));
                    w[c] = _mm256_and_si256(v, low);
                    w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
            }
            const uint8_t* sb = sc + b * scale_bytes(t) + half_scales * h;
            const __m256 d = load_scales(t, sb);
            const __m256 d2 = t == Q6_K ? _mm256_loadu_ps((const float*)(sb + 64)) : d;
            const __m256 mw = min_bytes(t) ? load_scales(t, mn + b * min_bytes(t) + half_scales * h) : d;
            #pragma GCC unroll 16
            for (int m = 0; m < rows; ++m) {
                const int8_t* xb = xq + m * k + b * QK;
                const int64_t i = m * nb + b;
                const __m256 x = _mm256_set1_ps(dx[i]);
                if (t == Q6_K) {
                    __m256i s0 = _mm256_set1_epi32(-off * sx[2 * i]), s1 = _mm256_set1_epi32(-off * sx[2 * i + 1]);
                    #pragma GCC unroll 4
                    for (int g = 0; g < 4; ++g) {
                        s0 = dot4(t, s0, w[g], bcast4(xb + 4 * g));
                        s1 = dot4(t, s1, w[g + 4], bcast4(xb + 16 + 4 * g));
                    }
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d, x), acc[m]);
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d2, x), acc[m]);
                    continue;
                }
                __m256i s = _mm256_set1_epi32(-off * (sx[2 * i] + sx[2 * i + 1]));
                #pragma GCC unroll 8
                for (int g = 0; g < 8; ++g) s = dot4(t, s, w[g], bcast4(xb + 4 * g));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, x), acc[m]);
                if (min_bytes(t))
                    acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(dx[i] * (float)(sx[2 * i] + sx[2 * i + 1])), acc[m]);
            }
        }
        const int64_t left = valid - 8 * h;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 bv = bias ? _mm256_maskload_ps(bias + 8 * h, mask) : _mm256_setzero_ps();
        #pragma GCC unroll 16
        for (int m = 0; m < rows; ++m) _mm256_maskstore_ps(out + m * ldo + 8 * h, mask, _mm256_add_ps(acc[m], bv));
    }
}
