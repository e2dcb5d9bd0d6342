/* The decode attention task on AVX2 (256-bit, 16 registers), any head_dim a multiple of 8
   (attention.c). Too few registers to hold a query and an accumulator per head across the
   context, so the work goes block by block (16 tokens): each head of the group takes the block's K
   rows (then V rows) from L1 after the first, its scaled query from a copy in L1, and its output
   accumulators are loaded and stored once per block. */
#include "vec_exp.h"

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sh[0:L] <- exp(sh - max(sh)); returns 1 / their sum (with query head j's sink where sinks: attention.c) */
static inline float softmax8(float* sh, int64_t L, const float* sinks, int64_t j) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sh + t));
    float m = hmax8(mv);
    for (int64_t u = t; u < L; ++u) m = sh[u] > m ? sh[u] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= L; t += 8) {
        const __m256 e = gs_exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), mb));
        _mm256_storeu_ps(sh + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum8(sv);
    if (t < L) {  /* the tail through an 8-float copy */
        float tail[8] = {0};
        for (int64_t u = t; u < L; ++u) tail[u - t] = sh[u];
        const __m256 e = gs_exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), mb));
        _mm256_storeu_ps(tail, e);
        for (int64_t u = t; u < L; ++u) { sh[u] = tail[u - t]; sum += tail[u - t]; }
    }
    float rescale;
    fold_sink(sinks, j, m, &sum, &rescale);
    return rescale / sum;
}

/* NV: head_dim / 8, a constant where the caller passes one (64, 128: fully unrolled) */
static inline __attribute__((always_inline)) void task256_body(const struct task* t, int64_t h, float* scores,
                                                              float* work, const int64_t NV) {
    const int64_t G = t->G, L = t->L, D = 8 * NV;
    float* qs = work;          /* [G, D] scaled queries */
    float* acc = work + G * D; /* [G, D] outputs, unnormalised */
    const __m256 sc = _mm256_set1_ps(t->scale);
    for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < NV; ++j) {
            _mm256_storeu_ps(qs + g * D + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(t->q + (h * G + g) * t->q_s1 + 8 * j), sc));
            _mm256_storeu_ps(acc + g * D + 8 * j, _mm256_setzero_ps());
        }
    for (int64_t t0 = 0; t0 < L; t0 += t->bs) {
        const float* kb = t->k_cache + (int64_t)t->table[t0 / t->bs] * t->blk_s + h * D;
        const int64_t n = L - t0 < t->bs ? L - t0 : t->bs;
        for (int64_t g = 0; g < G; ++g) {
            const float* qg = qs + g * D;
            for (int64_t o = t0 ? 0 : t->first; o < n; ++o) {
                const float* k = kb + o * t->tok_s;
                __m256 d0 = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(k)), d1 = _mm256_setzero_ps();
                for (int64_t j = 1; j < NV; ++j) {
                    if (j & 1) d1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), _mm256_loadu_ps(k + 8 * j), d1);
                    else d0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), _mm256_loadu_ps(k + 8 * j), d0);
                }
                scores[g * L + t0 + o] = hsum8(_mm256_add_ps(d0, d1));
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) qs[g] = softmax8(scores + g * L + t->first, L - t->first, t->sinks, h * G + g);  /* qs now holds 1 / sums */
    for (int64_t t0 = 0; t0 < L; t0 += t->bs) {
        const float* vb = t->v_cache + (int64_t)t->table[t0 / t->bs] * t->blk_s + h * D;
        const int64_t n = L - t0 < t->bs ? L - t0 : t->bs;
        for (int64_t g = 0; g < G; ++g) {
            const float* p = scores + g * L + t0;
            for (int64_t j0 = 0; j0 < NV; j0 += 8) {  /* 8 accumulators at a time */
                const int64_t nj = NV - j0 < 8 ? NV - j0 : 8;
                float* a = acc + g * D + 8 * j0;
                __m256 av[8];
                for (int64_t j = 0; j < nj; ++j) av[j] = _mm256_loadu_ps(a + 8 * j);
                for (int64_t o = t0 ? 0 : t->first; o < n; ++o) {
                    const __m256 pv = _mm256_set1_ps(p[o]);
                    const float* v = vb + o * t->tok_s + 8 * j0;
                    for (int64_t j = 0; j < nj; ++j) av[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * j), av[j]);
                }
                for (int64_t j = 0; j < nj; ++j) _mm256_storeu_ps(a + 8 * j, av[j]);
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        const __m256 inv = _mm256_set1_ps(qs[g]);
        for (int64_t j = 0; j < NV; ++j)
            _mm256_storeu_ps(t->out + (h * G + g) * D + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + 8 * j), inv));
    }
}

/* 1 where it took the task (head_dim a multiple of 8); work: 2 * G * D floats */
static int task_avx2(const struct task* t, int64_t h, float* scores, float* work) {
    if (t->D == 64) task256_body(t, h, scores, work, 8);
    else if (t->D == 128) task256_body(t, h, scores, work, 16);
    else if (t->D % 8 == 0) task256_body(t, h, scores, work, t->D / 8);
    else return 0;
    return 1;
}
