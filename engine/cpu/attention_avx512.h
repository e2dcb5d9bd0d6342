/* The decode attention task on AVX-512, head_dim 64 or 128 (attention.c). One (sequence, KV head)
   task with head_dim 16 * NV, its G query heads in register blocks of GS: each K and V row is
   loaded once per block and used for every head of the block; the query (scaled) and the output
   accumulators stay in registers across the whole context. */
#include "vec_exp.h"

/* sh[0:L] <- exp(sh - max(sh)); returns 1 / their sum (with query head j's sink where sinks: attention.c) */
static inline float softmax16(float* sh, int64_t L, const float* sinks, int64_t j) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= L; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sh + t));
    const __mmask16 tail = (__mmask16)((1u << (L - t)) - 1);
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, sh + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sv = _mm512_setzero_ps();
    for (t = 0; t + 16 <= L; t += 16) {
        const __m512 e = gs_exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + t), m));
        _mm512_storeu_ps(sh + t, e);
        sv = _mm512_add_ps(sv, e);
    }
    const __m512 e = _mm512_maskz_mov_ps(tail, gs_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sh + t), m)));
    _mm512_mask_storeu_ps(sh + t, tail, e);
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(sv, e)), rescale;
    fold_sink(sinks, j, _mm512_reduce_max_ps(m), &sum, &rescale);
    return rescale / sum;
}

#define DEFINE_TASK512(NV, GS)                                                                       \
static void task512_##NV(const float* qb, int64_t q_s1, const float* k_cache, const float* v_cache,  \
                         const int32_t* table, int64_t L, int64_t h, int64_t G, int64_t bs,          \
                         int64_t tok_s, int64_t blk_s, float scale, float* scores, float* outb,      \
                         int64_t first, const float* sinks) {                                        \
    for (int64_t g0 = 0; g0 < G; g0 += GS) {                                                         \
        const int64_t gn = G - g0 < GS ? G - g0 : GS;                                                \
        __m512 qv[GS][NV], acc[GS][NV];                                                              \
        const __m512 sc = _mm512_set1_ps(scale);                                                     \
        for (int g = 0; g < GS; ++g)                                                                 \
            for (int j = 0; j < NV; ++j) {                                                           \
                qv[g][j] = g < gn ? _mm512_mul_ps(_mm512_loadu_ps(qb + (h * G + g0 + g) * q_s1 + 16 * j), sc) \
                                  : _mm512_setzero_ps();                                             \
                acc[g][j] = _mm512_setzero_ps();                                                     \
            }                                                                                        \
        for (int64_t t0 = 0; t0 < L; t0 += bs) {                                                     \
            const float* kb = k_cache + (int64_t)table[t0 / bs] * blk_s + h * 16 * NV;               \
            const int64_t n = L - t0 < bs ? L - t0 : bs;                                             \
            for (int64_t o = t0 ? 0 : first; o < n; ++o) {                                          \
                __m512 kv[NV];                                                                       \
                for (int j = 0; j < NV; ++j) kv[j] = _mm512_loadu_ps(kb + o * tok_s + 16 * j);       \
                for (int g = 0; g < GS; ++g) {                                                       \
                    if (g >= gn) break;                                                              \
                    __m512 d = _mm512_mul_ps(qv[g][0], kv[0]);                                       \
                    for (int j = 1; j < NV; ++j) d = _mm512_fmadd_ps(qv[g][j], kv[j], d);            \
                    scores[(g0 + g) * L + t0 + o] = _mm512_reduce_add_ps(d);                         \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        float inv[GS];                                                                               \
        for (int g = 0; g < gn; ++g)                                                                 \
            inv[g] = softmax16(scores + (g0 + g) * L + first, L - first, sinks, h * G + g0 + g);     \
        for (int64_t t0 = 0; t0 < L; t0 += bs) {                                                     \
            const float* vb = v_cache + (int64_t)table[t0 / bs] * blk_s + h * 16 * NV;               \
            const int64_t n = L - t0 < bs ? L - t0 : bs;                                             \
            for (int64_t o = t0 ? 0 : first; o < n; ++o) {                                          \
                __m512 vv[NV];                                                                       \
                for (int j = 0; j < NV; ++j) vv[j] = _mm512_loadu_ps(vb + o * tok_s + 16 * j);       \
                for (int g = 0; g < GS; ++g) {                                                       \
                    if (g >= gn) break;                                                              \
                    const __m512 p = _mm512_set1_ps(scores[(g0 + g) * L + t0 + o]);                  \
                    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);   \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int g = 0; g < gn; ++g)                                                                 \
            for (int j = 0; j < NV; ++j)                                                             \
                _mm512_storeu_ps(outb + (h * G + g0 + g) * 16 * NV + 16 * j,                         \
                                 _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv[g])));                  \
    }                                                                                                \
}
DEFINE_TASK512(4, 4)  /* head_dim 64: 16 + 16 registers */
DEFINE_TASK512(8, 2)  /* head_dim 128 */

/* 1 where it took the task (head_dim 64 or 128) */
static int task_avx512(const struct task* t, int64_t h, float* scores, float* work) {
    (void)work;
    if (t->D == 64)
        task512_4(t->q, t->q_s1, t->k_cache, t->v_cache, t->table, t->L, h, t->G, t->bs, t->tok_s, t->blk_s,
                  t->scale, scores, t->out, t->first, t->sinks);
    else if (t->D == 128)
        task512_8(t->q, t->q_s1, t->k_cache, t->v_cache, t->table, t->L, h, t->G, t->bs, t->tok_s, t->blk_s,
                  t->scale, scores, t->out, t->first, t->sinks);
    else
        return 0;
    return 1;
}
