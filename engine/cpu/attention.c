/* Paged decode attention for the CPU backend (engine/cpu/attention.py):
   out[b, h*G + g, :] = softmax_t(scale * q[b, h*G + g, :] . K[b, t, h, :]) @ V[b, t, h, :]
   over t < context_lens[b], token t of row b at block block_tables[b, t / bs], offset t % bs; with a
   sliding window (window > 0) only over the last `window` of those (t >= context_lens[b] - window, as
   transformers masks: the query's own position and the window - 1 before it). With sinks (gpt-oss; NULL:
   none) query head j's softmax has one more term in its denominator, exp(sinks[j]), no value with it.
   q and out: [B, Hq, D] with strides (q_s0, q_s1, 1) and (Hq * D, D, 1);
   caches: [num_blocks, bs, Hkv, D] contiguous.
   One task per sequence (its blocks read whole, in order), or with split_heads (few rows) per
   (sequence, KV head); each task's heads go to the widest vector path this build has for the
   head_dim, else the plain C one. */
#include "isa.h"
#include "parallel.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* one (sequence, KV heads) task's inputs: q and out point at the sequence's rows */
struct task {
    const float* q;
    int64_t q_s1;
    const float *k_cache, *v_cache;
    const int32_t* table;
    int64_t L, G, D, bs, tok_s, blk_s;
    float scale;
    float* out;
    /* the first `first` tokens of the first block (table[0]) lie before the window: never read */
    int64_t first;
    const float* sinks; /* [Hq] or NULL */
};

/* the sink of query head j folded into a softmax whose exps were taken against max m: returns the new
   max (>= m) and rescales *sum (the exps' sum) to it, the sink's term added; *rescale: what the exps
   taken against m must be multiplied by. Without a sink (NULL), nothing changes. */
static inline float fold_sink(const float* sinks, int64_t j, float m, float* sum, float* rescale) {
    *rescale = 1.f;
    if (!sinks) return m;
    const float s = sinks[j];
    if (s > m) {
        *rescale = expf(m - s);
        *sum = *sum * *rescale + 1.f;
        return s;
    }
    *sum += expf(s - m);
    return m;
}


#if defined(GS_AVX512)
#include "attention_avx512.h"
#endif
#if defined(GS_AVX2)
#include "attention_avx2.h"
#endif
#if defined(GS_NEON)
#include "attention_neon.h"
#endif

const char* gs_isa(void) { return GS_ISA_NAME; }

/* KV head h of a task in plain C; work: G * D floats */
static void task_generic(const struct task* t, int64_t h, float* scores, float* acc) {
    const int64_t G = t->G, L = t->L, D = t->D, first = t->first;
    for (int64_t t0 = 0; t0 < L; t0 += t->bs) {
        const float* kb = t->k_cache + (int64_t)t->table[t0 / t->bs] * t->blk_s + h * D;
        const int64_t n = L - t0 < t->bs ? L - t0 : t->bs;
        for (int64_t o = t0 ? 0 : first; o < n; ++o) {
            const float* k = kb + o * t->tok_s;
            for (int64_t g = 0; g < G; ++g) {
                const float* qh = t->q + (h * G + g) * t->q_s1;
                float s = 0.f;
                #pragma omp simd reduction(+:s)
                for (int64_t d = 0; d < D; ++d) s += qh[d] * k[d];
                scores[g * L + t0 + o] = s * t->scale;
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float* sh = scores + g * L;
        float m = -INFINITY, sum = 0.f, rescale;
        for (int64_t u = first; u < L; ++u) m = sh[u] > m ? sh[u] : m;
        for (int64_t u = first; u < L; ++u) { sh[u] = expf(sh[u] - m); sum += sh[u]; }
        fold_sink(t->sinks, h * G + g, m, &sum, &rescale);
        const float inv = rescale / sum;
        for (int64_t u = first; u < L; ++u) sh[u] *= inv;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t t0 = 0; t0 < L; t0 += t->bs) {
        const float* vb = t->v_cache + (int64_t)t->table[t0 / t->bs] * t->blk_s + h * D;
        const int64_t n = L - t0 < t->bs ? L - t0 : t->bs;
        for (int64_t o = t0 ? 0 : first; o < n; ++o) {
            const float* v = vb + o * t->tok_s;
            for (int64_t g = 0; g < G; ++g) {
                const float p = scores[g * L + t0 + o];
                float* a = acc + g * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
            }
        }
    }
    memcpy(t->out + h * G * D, acc, sizeof(float) * G * D);
}

/* a growing buffer per thread, kept for the thread's life: no allocation per task */
static _Thread_local float* scratch;
static _Thread_local int64_t scratch_cap;

static float* scratch_floats(int64_t n) {
    if (n > scratch_cap) {
        free(scratch);
        scratch = (float*)malloc(sizeof(float) * (size_t)n);
        scratch_cap = scratch ? n : 0;
    }
    return scratch;
}

struct call {
    const float* q;
    int64_t q_s0, q_s1;
    const float *k_cache, *v_cache;
    const int32_t* block_tables;
    int64_t bt_s0;
    const int32_t* context_lens;
    float* out;
    int64_t Hq, Hkv, D, bs, per_row, heads;
    float scale;
    int64_t window;
    const float* sinks;
};

static void run_tasks(void* arg, int64_t begin, int64_t end) {
    const struct call* c = (const struct call*)arg;
    const int64_t G = c->Hq / c->Hkv;
    for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / c->per_row, h0 = (i % c->per_row) * c->heads, h1 = h0 + c->heads;
        const int64_t ctx = c->context_lens[b];
        /* a window: the blocks wholly before it are skipped, the first `first` tokens of the next never read */
        const int64_t lo = c->window > 0 && ctx > c->window ? ctx - c->window : 0, skip = lo / c->bs;
        const struct task t = {c->q + b * c->q_s0, c->q_s1, c->k_cache, c->v_cache,
                               c->block_tables + b * c->bt_s0 + skip, ctx - skip * c->bs, G, c->D, c->bs,
                               c->Hkv * c->D, c->bs * c->Hkv * c->D, c->scale, c->out + b * c->Hq * c->D,
                               lo - skip * c->bs, c->sinks};
        float* scores = scratch_floats(G * t.L + 2 * G * c->D);
        float* work = scores + G * t.L;
        for (int64_t h = h0; h < h1; ++h) {
#if defined(GS_AVX512)
            if (task_avx512(&t, h, scores, work)) continue;
#endif
#if defined(GS_AVX2)
            if (task_avx2(&t, h, scores, work)) continue;
#endif
#if defined(GS_NEON)
            if (task_neon(&t, h, scores, work)) continue;
#endif
            task_generic(&t, h, scores, work);
        }
    }
}

void paged_decode(const float* q, int64_t q_s0, int64_t q_s1, const float* k_cache, const float* v_cache,
                  const int32_t* block_tables, int64_t bt_s0, const int32_t* context_lens,
                  float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale,
                  int64_t split_heads, int64_t window, const float* sinks) {
    const struct call c = {q, q_s0, q_s1, k_cache, v_cache, block_tables, bt_s0, context_lens, out, Hq, Hkv, D, bs,
                           split_heads ? Hkv : 1, split_heads ? 1 : Hkv, scale, window, sinks};
    gs_parallel_for_each(B * c.per_row, run_tasks, (void*)&c);
}
