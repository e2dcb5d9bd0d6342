/* quant_linear.c's panel block in plain C, which every CPU runs: exact int32 block sums, then the
   same float steps as the vector blocks */
static inline float scale_at(const int t, const uint8_t* p, int j) {
    if (t == Q4_K || t == Q6_K) { float f; memcpy(&f, p + 4 * j, 4); return f; }
    uint16_t h; memcpy(&h, p + 2 * j, 2); return half_to_float(h);
}
/* the same arithmetic in plain C: exact int32 block sums, then the same float steps */
static void block(const int t, const int rows, const int8_t* xq, int64_t k, const float* dx,
        const int32_t* sx, int64_t nb, const uint8_t* panel, const float* bias, float* out,
        int64_t ldo, int64_t valid) {
    const uint8_t* qs = panel;
    const uint8_t* sc = qs + nb * quant_bytes(t);
    const uint8_t* mn = sc + nb * scale_bytes(t);
    float acc[MAX_ROWS][PANEL] = {{0}};
    uint8_t w[QK][PANEL];
    float d[PANEL], d2[PANEL], mw[PANEL];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* q = qs + b * quant_bytes(t);
        for (int g = 0; g < 8; ++g)
            for (int j = 0; j < PANEL; ++j)
                for (int e = 0; e < 4; ++e) {
                    const uint8_t byte = (t == Q8_0 || t == Q6_K) ? q[g * 64 + j * 4 + e] : q[(g & 3) * 64 + j * 4 + e];
                    w[4 * g + e][j] = (t == Q8_0 || t == Q6_K) ? byte : g < 4 ? byte & 15 : byte >> 4;
                }
        for (int j = 0; j < PANEL; ++j) {
            d[j] = scale_at(t, sc + b * scale_bytes(t), j);
            d2[j] = t == Q6_K ? scale_at(t, sc + b * scale_bytes(t) + 64, j) : d[j];
            mw[j] = min_bytes(t) ? scale_at(t, mn + b * min_bytes(t), j) : 0.f;
        }
        for (int m = 0; m < rows; ++m) {
            const int8_t* xb = xq + m * k + b * QK;
            const int64_t i = m * nb + b;
            int32_t s0[PANEL], s1[PANEL];
            for (int j = 0; j < PANEL; ++j) { s0[j] = -offset(t) * sx[2 * i]; s1[j] = -offset(t) * sx[2 * i + 1]; }
            for (int kk = 0; kk < QK; ++kk) {
                const int32_t xv = xb[kk];
                int32_t* s = kk < QK / 2 ? s0 : s1;
                #pragma omp simd
                for (int j = 0; j < PANEL; ++j) s[j] += (int32_t)w[kk][j] * xv;
            }
            for (int j = 0; j < PANEL; ++j) {
                if (t == Q6_K) {
                    acc[m][j] += (float)s0[j] * (d[j] * dx[i]);
                    acc[m][j] += (float)s1[j] * (d2[j] * dx[i]);
                } else {
                    acc[m][j] += (float)(s0[j] + s1[j]) * (d[j] * dx[i]);
                    if (min_bytes(t)) acc[m][j] += mw[j] * (dx[i] * (float)(sx[2 * i] + sx[2 * i + 1]));
                }
            }
        }
    }
    for (int m = 0; m < rows; ++m)
        for (int j = 0; j < valid; ++j) out[m * ldo + j] = acc[m][j] + (bias ? bias[j] : 0.f);
}
#define GS_QUANT_PATH "generic"
