/* The decode attention task on NEON (128-bit, 32 registers), any head_dim a multiple of 4
   (attention.c). The AVX2 task's order on 4-lane vectors: block by block (16 tokens), each head of
   the group taking the block's K rows (then V rows) from L1 after the first, its scaled query
   from a copy in L1, its output accumulators loaded and stored once per block, 16 registers
   of them at a time (the other 16 hold the V rows' loads and the probability). */
#include "vec_exp.h"

/* sh[0:L] <- exp(sh - max(sh)); returns 1 / their sum (with query head j's sink where sinks: attention.c) */
static inline float softmax4(float* sh, int64_t L, const float* sinks, int64_t j) {
    float32x4_t mv = vdupq_n_f32(-INFINITY);
    int64_t t = 0;
    for (; t + 4 <= L; t += 4) mv = vmaxq_f32(mv, vld1q_f32(sh + t));
    float m = vmaxvq_f32(mv);
    for (int64_t u = t; u < L; ++u) m = sh[u] > m ? sh[u] : m;
    const float32x4_t mb = vdupq_n_f32(m);
    float32x4_t sv = vdupq_n_f32(0.f);
    for (t = 0; t + 4 <= L; t += 4) {
        const float32x4_t e = gs_exp4(vsubq_f32(vld1q_f32(sh + t), mb));
        vst1q_f32(sh + t, e);
        sv = vaddq_f32(sv, e);
    }
    float sum = vaddvq_f32(sv);
    if (t < L) {  /* the tail through a 4-float copy: the same exp as the rest */
        float tail[4] = {0};
        for (int64_t u = t; u < L; ++u) tail[u - t] = sh[u];
        vst1q_f32(tail, gs_exp4(vsubq_f32(vld1q_f32(tail), mb)));
        for (int64_t u = t; u < L; ++u) { sh[u] = tail[u - t]; sum += tail[u - t]; }
    }
    float rescale;
    fold_sink(sinks, j, m, &sum, &rescale);
    return rescale / sum;
}

/* NV: head_dim / 4, a constant where the caller passes one (64, 128: fully unrolled) */
static inline __attribute__((always_inline)) void task128_body(const struct task* t, int64_t h, float* scores,
                                                              float* work, const int64_t NV) {
    const int64_t G = t->G, L = t->L, D = 4 * NV;
    float* qs = work;          /* [G, D] scaled queries */
    float* acc = work + G * D; /* [G, D] outputs, unnormalised */
    const float32x4_t sc = vdupq_n_f32(t->scale);
    for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < NV; ++j) {
            vst1q_f32(qs + g * D + 4 * j, vmulq_f32(vld1q_f32(t->q + (h * G + g) * t->q_s1 + 4 * j), sc));
            vst1q_f32(acc + g * D + 4 * j, vdupq_n_f32(0.f));
        }
    for (int64_t t0 = 0; t0 < L; t0 += t->bs) {
        const float* kb = t->k_cache + (int64_t)t->table[t0 / t->bs] * t->blk_s + h * D;
        const int64_t n = L - t0 < t->bs ? L - t0 : t->bs;
        for (int64_t g = 0; g < G; ++g) {
            const float* qg = qs + g * D;
            for (int64_t o = t0 ? 0 : t->first; o < n; ++o) {
                const float* k = kb + o * t->tok_s;
                /* four independent sums: the FMA latency, not one chain */
                float32x4_t d[4] = {vmulq_f32(vld1q_f32(qg), vld1q_f32(k)), vdupq_n_f32(0.f), vdupq_n_f32(0.f),
                                    vdupq_n_f32(0.f)};
                for (int64_t j = 1; j < NV; ++j) d[j & 3] = vfmaq_f32(d[j & 3], vld1q_f32(qg + 4 * j), vld1q_f32(k + 4 * j));
                scores[g * L + t0 + o] = vaddvq_f32(vaddq_f32(vaddq_f32(d[0], d[1]), vaddq_f32(d[2], d[3])));
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) qs[g] = softmax4(scores + g * L + t->first, L - t->first, t->sinks, h * G + g);  /* qs now holds 1 / sums */
    for (int64_t t0 = 0; t0 < L; t0 += t->bs) {
        const float* vb = t->v_cache + (int64_t)t->table[t0 / t->bs] * t->blk_s + h * D;
        const int64_t n = L - t0 < t->bs ? L - t0 : t->bs;
        for (int64_t g = 0; g < G; ++g) {
            const float* p = scores + g * L + t0;
            for (int64_t j0 = 0; j0 < NV; j0 += 16) {  /* 16 accumulators at a time */
                const int64_t nj = NV - j0 < 16 ? NV - j0 : 16;
                float* a = acc + g * D + 4 * j0;
                float32x4_t av[16];
                for (int64_t j = 0; j < nj; ++j) av[j] = vld1q_f32(a + 4 * j);
                for (int64_t o = t0 ? 0 : t->first; o < n; ++o) {
                    const float32x4_t pv = vdupq_n_f32(p[o]);
                    const float* v = vb + o * t->tok_s + 4 * j0;
                    for (int64_t j = 0; j < nj; ++j) av[j] = vfmaq_f32(av[j], pv, vld1q_f32(v + 4 * j));
                }
                for (int64_t j = 0; j < nj; ++j) vst1q_f32(a + 4 * j, av[j]);
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        const float32x4_t inv = vdupq_n_f32(qs[g]);
        for (int64_t j = 0; j < NV; ++j)
            vst1q_f32(t->out + (h * G + g) * D + 4 * j, vmulq_f32(vld1q_f32(acc + g * D + 4 * j), inv));
    }
}

/* 1 where it took the task (head_dim a multiple of 4); work: 2 * G * D floats */
static int task_neon(const struct task* t, int64_t h, float* scores, float* work) {
    if (t->D == 64) task128_body(t, h, scores, work, 16);
    else if (t->D == 128) task128_body(t, h, scores, work, 32);
    else if (t->D % 4 == 0) task128_body(t, h, scores, work, t->D / 4);
    else return 0;
    return 1;
}
