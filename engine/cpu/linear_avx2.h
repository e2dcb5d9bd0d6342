/* linear.c's panel block on AVX2 (16 registers): rows (<= 6) x 16 outputs, two accumulator
   registers per row; more rows take the panel again from the cache, 6 at a time */
#define GS_LINEAR_ROWS 6
static inline __attribute__((always_inline)) void block(const int rows, const float* x, int64_t ldx,
        const float* panel, int64_t k, const float* bias, float* out, int64_t ldo, int64_t valid) {
    __m256 lo[GS_LINEAR_ROWS], hi[GS_LINEAR_ROWS];
    #pragma GCC unroll 6
    for (int m = 0; m < rows; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
        _mm_prefetch((const char*)(panel + kk * PANEL + PREFETCH), _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(panel + kk * PANEL), w1 = _mm256_loadu_ps(panel + kk * PANEL + 8);
        #pragma GCC unroll 6
        for (int m = 0; m < rows; ++m) {
            const __m256 xv = _mm256_broadcast_ss(x + m * ldx + kk);
            lo[m] = _mm256_fmadd_ps(w0, xv, lo[m]);
            hi[m] = _mm256_fmadd_ps(w1, xv, hi[m]);
        }
    }
    float tmp[PANEL];
    for (int m = 0; m < rows; ++m) {
        _mm256_storeu_ps(tmp, lo[m]);
        _mm256_storeu_ps(tmp + 8, hi[m]);
        for (int64_t j = 0; j < valid; ++j) out[m * ldo + j] = tmp[j] + (bias ? bias[j] : 0.f);
    }
}
