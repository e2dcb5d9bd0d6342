/* linear.c's panel block on NEON (32 registers): rows (<= 6) x 16 outputs, four accumulator
   registers per row (24), the panel's four weight registers and the row's broadcast; more rows
   take the panel again from the cache, 6 at a time */
#define GS_LINEAR_ROWS 6
static inline __attribute__((always_inline)) void block(const int rows, const float* x, int64_t ldx,
        const float* panel, int64_t k, const float* bias, float* out, int64_t ldo, int64_t valid) {
    float32x4_t acc[GS_LINEAR_ROWS][4];
    #pragma GCC unroll 6
    for (int m = 0; m < rows; ++m)
        for (int j = 0; j < 4; ++j) acc[m][j] = vdupq_n_f32(0.f);
    for (int64_t kk = 0; kk < k; ++kk) {
        __builtin_prefetch(panel + kk * PANEL + PREFETCH);
        const float* wk = panel + kk * PANEL;
        const float32x4_t w0 = vld1q_f32(wk), w1 = vld1q_f32(wk + 4), w2 = vld1q_f32(wk + 8), w3 = vld1q_f32(wk + 12);
        #pragma GCC unroll 6
        for (int m = 0; m < rows; ++m) {
            const float32x4_t xv = vld1q_dup_f32(x + m * ldx + kk);
            acc[m][0] = vfmaq_f32(acc[m][0], w0, xv);
            acc[m][1] = vfmaq_f32(acc[m][1], w1, xv);
            acc[m][2] = vfmaq_f32(acc[m][2], w2, xv);
            acc[m][3] = vfmaq_f32(acc[m][3], w3, xv);
        }
    }
    float tmp[PANEL];
    for (int m = 0; m < rows; ++m) {
        for (int j = 0; j < 4; ++j) vst1q_f32(tmp + 4 * j, acc[m][j]);
        for (int64_t j = 0; j < valid; ++j) out[m * ldo + j] = tmp[j] + (bias ? bias[j] : 0.f);
    }
}
