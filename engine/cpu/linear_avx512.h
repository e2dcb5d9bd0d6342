/* linear.c's panel block on AVX-512: rows (<= 16) x 16 outputs, one accumulator register per row */
#define GS_LINEAR_ROWS 16
static inline __attribute__((always_inline)) void block(const int rows, const float* x, int64_t ldx,
        const float* panel, int64_t k, const float* bias, float* out, int64_t ldo, int64_t valid) {
    __m512 acc[GS_LINEAR_ROWS];
    #pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
        _mm_prefetch((const char*)(panel + kk * PANEL + PREFETCH), _MM_HINT_T0);
        const __m512 w = _mm512_loadu_ps(panel + kk * PANEL);
        #pragma GCC unroll 16
        for (int m = 0; m < rows; ++m) acc[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m * ldx + kk]), acc[m]);
    }
    const __mmask16 mask = valid >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) _mm512_mask_storeu_ps(out + m * ldo, mask, _mm512_add_ps(acc[m], b));
}
