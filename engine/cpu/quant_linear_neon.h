/* quant_linear.c's panel block on NEON: the same arithmetic as the x86 blocks (same layout, same
   exact int32 block sums, the same float steps), in four passes of 4 outputs, each taking the 16
   bytes of every 64 that are its rows'. The int8 products: i8mm's smmla two rows at a time (2 rows
   x 8 K of activations against 2 weight rows x 8 K, the weights zipped once per block for every
   pair), dotprod's sdot for one row, else vmull_s8 and pairwise adds. All of them multiply signed
   by signed: Q8_0's stored +128 becomes signed again by xor 0x80 (offset 0); the 4- and 6-bit
   quants are below 128 as they are, their offset subtracted through the activation sums. */
static inline __attribute__((always_inline)) float32x4_t load_scales(const int t, const uint8_t* p) {
    return (t == Q4_K || t == Q6_K) ? vld1q_f32((const float*)p)
                                    : vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)p)));
}

/* s + the products of 4 groups of 4 K (w[g]: rows 4r..4r+3, 4 K each) with the 16 activations x
   (group g's 4 at lane g) */
static inline __attribute__((always_inline)) int32x4_t dot16(int32x4_t s, const int8x16_t* w, int8x16_t x) {
#if defined(GS_DOTPROD)
    s = vdotq_laneq_s32(s, w[0], x, 0);
    s = vdotq_laneq_s32(s, w[1], x, 1);
    s = vdotq_laneq_s32(s, w[2], x, 2);
    return vdotq_laneq_s32(s, w[3], x, 3);
#else
    /* each int16 lane sums two products of at most 128 * 127: no overflow */
    const int32x4_t x32 = vreinterpretq_s32_s8(x);
    const int8x16_t x0 = vreinterpretq_s8_s32(vdupq_laneq_s32(x32, 0)), x1 = vreinterpretq_s8_s32(vdupq_laneq_s32(x32, 1));
    const int8x16_t x2 = vreinterpretq_s8_s32(vdupq_laneq_s32(x32, 2)), x3 = vreinterpretq_s8_s32(vdupq_laneq_s32(x32, 3));
    int16x8_t lo = vmlal_s8(vmull_s8(vget_low_s8(w[0]), vget_low_s8(x0)), vget_low_s8(w[1]), vget_low_s8(x1));
    int16x8_t hi = vmlal_high_s8(vmull_high_s8(w[0], x0), w[1], x1);
    int32x4_t a = vpaddlq_s16(lo), b = vpaddlq_s16(hi);  /* a: rows 4r, 4r, 4r+1, 4r+1; b: 4r+2, 4r+3 */
    lo = vmlal_s8(vmull_s8(vget_low_s8(w[2]), vget_low_s8(x2)), vget_low_s8(w[3]), vget_low_s8(x3));
    hi = vmlal_high_s8(vmull_high_s8(w[2], x2), w[3], x3);
    a = vpadalq_s16(a, lo);
    b = vpadalq_s16(b, hi);
    return vaddq_s32(s, vpaddq_s32(a, b));
#endif
}

/* acc + one row's block: s0, s1 its int32 sums over K 0-15 and 16-31 (offset not yet subtracted);
   the float steps of the x86 blocks */
static inline __attribute__((always_inline)) float32x4_t accumulate(const int t, float32x4_t acc, int32x4_t s0,
        int32x4_t s1, float32x4_t d, float32x4_t d2, float32x4_t mw, float dxi, const int32_t* sxi) {
    const int32_t off = t == Q8_0 ? 0 : offset(t);
    const float32x4_t x = vdupq_n_f32(dxi);
    if (t == Q6_K) {  /* a scale per half block */
        acc = vfmaq_f32(acc, vcvtq_f32_s32(vaddq_s32(s0, vdupq_n_s32(-off * sxi[0]))), vmulq_f32(d, x));
        return vfmaq_f32(acc, vcvtq_f32_s32(vaddq_s32(s1, vdupq_n_s32(-off * sxi[1]))), vmulq_f32(d2, x));
    }
    const int32x4_t s = vaddq_s32(vaddq_s32(s0, s1), vdupq_n_s32(-off * (sxi[0] + sxi[1])));
    acc = vfmaq_f32(acc, vcvtq_f32_s32(s), vmulq_f32(d, x));
    if (min_bytes(t)) acc = vfmaq_f32(acc, mw, vdupq_n_f32(dxi * (float)(sxi[0] + sxi[1])));
    return acc;
}

#if defined(GS_I8MM)
#define GS_QUANT_PATH "NEON i8mm"
#elif defined(GS_DOTPROD)
#define GS_QUANT_PATH "NEON dotprod"
#else
#define GS_QUANT_PATH "NEON"
#endif

static inline __attribute__((always_inline)) void block(const int t, const int rows, const int8_t* xq,
        int64_t k, const float* dx, const int32_t* sx, int64_t nb, const uint8_t* panel,
        const float* bias, float* out, int64_t ldo, int64_t valid) {
    const uint8_t* qs = panel;
    const uint8_t* sc = qs + nb * quant_bytes(t);
    const uint8_t* mn = sc + nb * scale_bytes(t);
    const int64_t quarter_scales = (t == Q4_K || t == Q6_K) ? 16 : 8;  /* bytes of 4 rows' scales */
    for (int r = 0; r < 4 && 4 * r < valid; ++r) {
        float32x4_t acc[MAX_ROWS];
        #pragma GCC unroll 16
        for (int m = 0; m < rows; ++m) acc[m] = vdupq_n_f32(0.f);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* q = qs + b * quant_bytes(t) + 16 * r;
            int8x16_t w[8];  /* w[g]: K 4g..4g+3 of rows 4r..4r+3 */
            if (t == Q8_0 || t == Q6_K) {
                #pragma GCC unroll 8
                for (int g = 0; g < 8; ++g) {
                    if (r == 0) __builtin_prefetch(q + PREFETCH + 64 * g);
                    w[g] = vld1q_s8((const int8_t*)(q + 64 * g));
                    if (t == Q8_0) w[g] = veorq_s8(w[g], vdupq_n_s8(-128));
                }
            } else {
                #pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) {
                    if (r == 0) __builtin_prefetch(q + PREFETCH + 64 * c);
                    const uint8x16_t v = vld1q_u8(q + 64 * c);
                    w[c] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
                    w[c + 4] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
                }
            }
            const uint8_t* sb = sc + b * scale_bytes(t) + quarter_scales * r;
            const float32x4_t d = load_scales(t, sb);
            const float32x4_t d2 = t == Q6_K ? vld1q_f32((const float*)(sb + 64)) : d;
            const float32x4_t mw = min_bytes(t) ? load_scales(t, mn + b * min_bytes(t) + quarter_scales * r) : d;
            int m = 0;
#if defined(GS_I8MM)
            /* wz[2p]: rows 4r, 4r+1 x K 8p..8p+7; wz[2p + 1]: rows 4r+2, 4r+3 */
            int8x16_t wz[8];
            #pragma GCC unroll 4
            for (int p = 0; p < 4; ++p) {
                const int32x4_t a = vreinterpretq_s32_s8(w[2 * p]), c = vreinterpretq_s32_s8(w[2 * p + 1]);
                wz[2 * p] = vreinterpretq_s8_s32(vzip1q_s32(a, c));
                wz[2 * p + 1] = vreinterpretq_s8_s32(vzip2q_s32(a, c));
            }
            #pragma GCC unroll 8
            for (; m + 1 < rows; m += 2) {
                const int8_t* xa = xq + m * k + b * QK;
                /* per half block: [row m, m+1] x [rows 4r, 4r+1], then x [rows 4r+2, 4r+3] */
                int32x4_t s[2][2] = {{vdupq_n_s32(0), vdupq_n_s32(0)}, {vdupq_n_s32(0), vdupq_n_s32(0)}};
                #pragma GCC unroll 4
                for (int p = 0; p < 4; ++p) {
                    const int64x2_t a = vreinterpretq_s64_s8(vld1q_s8(xa + 16 * (p / 2)));
                    const int64x2_t c = vreinterpretq_s64_s8(vld1q_s8(xa + k + 16 * (p / 2)));
                    const int8x16_t xp = vreinterpretq_s8_s64((p & 1) ? vzip2q_s64(a, c) : vzip1q_s64(a, c));
                    s[p / 2][0] = vmmlaq_s32(s[p / 2][0], xp, wz[2 * p]);
                    s[p / 2][1] = vmmlaq_s32(s[p / 2][1], xp, wz[2 * p + 1]);
                }
                for (int e = 0; e < 2; ++e) {  /* row m + e: lanes 2e, 2e+1 of each product */
                    int32x4_t half[2];
                    for (int hb = 0; hb < 2; ++hb) {
                        const int64x2_t u = vreinterpretq_s64_s32(s[hb][0]), v = vreinterpretq_s64_s32(s[hb][1]);
                        half[hb] = vreinterpretq_s32_s64(e ? vzip2q_s64(u, v) : vzip1q_s64(u, v));
                    }
                    const int64_t i = (m + e) * nb + b;
                    acc[m + e] = accumulate(t, acc[m + e], half[0], half[1], d, d2, mw, dx[i], sx + 2 * i);
                }
            }
#endif
            #pragma GCC unroll 16
            for (; m < rows; ++m) {
                const int8_t* xb = xq + m * k + b * QK;
                const int64_t i = m * nb + b;
                const int32x4_t s0 = dot16(vdupq_n_s32(0), w, vld1q_s8(xb));
                const int32x4_t s1 = dot16(vdupq_n_s32(0), w + 4, vld1q_s8(xb + 16));
                acc[m] = accumulate(t, acc[m], s0, s1, d, d2, mw, dx[i], sx + 2 * i);
            }
        }
        const int64_t left = valid - 4 * r;
        if (left >= 4) {
            const float32x4_t bv = bias ? vld1q_f32(bias + 4 * r) : vdupq_n_f32(0.f);
            #pragma GCC unroll 16
            for (int m = 0; m < rows; ++m) vst1q_f32(out + m * ldo + 4 * r, vaddq_f32(acc[m], bv));
        } else {
            float tmp[4];
            for (int m = 0; m < rows; ++m) {
                vst1q_f32(tmp, acc[m]);
                for (int64_t j = 0; j < left; ++j) out[m * ldo + 4 * r + j] = tmp[j] + (bias ? bias[4 * r + j] : 0.f);
            }
        }
    }
}
