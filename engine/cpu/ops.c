/* The CPU backend's elementwise fusions, float32 (engine/cpu/ops.py): RMSNorm with the residual
   add before it, and SiLU-and-mul, each one pass. */
#include "isa.h"
#include "parallel.h"
#include "vec_exp.h"

#include <math.h>
#include <stdint.h>

const char* gs_isa(void) { return GS_ISA_NAME; }

/* rows below this many floats in all run in the caller's thread */
#define PARALLEL_FROM 262144

struct norm_call {
    const float* x;
    int64_t ldx;
    const float* residual;
    int64_t ldr;
    const float* weight;
    float eps;
    int64_t hidden;
    float* out;
    int64_t ldo;
    float* res_out;
    int64_t ldro;
};

static void norm_rows(void* arg, int64_t begin, int64_t end) {
    const struct norm_call* c = (const struct norm_call*)arg;
    const int64_t hidden = c->hidden;
    for (int64_t m = begin; m < end; ++m) {
        const float* xm = c->x + m * c->ldx;
        float* om = c->out + m * c->ldo;
        const float* h = xm;
        if (c->residual) {
            float* rm = c->res_out + m * c->ldro;
            const float* rr = c->residual + m * c->ldr;
            #pragma omp simd
            for (int64_t j = 0; j < hidden; ++j) rm[j] = xm[j] + rr[j];
            h = rm;
        }
        float sq = 0.f;
        #pragma omp simd reduction(+:sq)
        for (int64_t j = 0; j < hidden; ++j) sq += h[j] * h[j];
        const float inv = 1.f / sqrtf(sq / (float)hidden + c->eps);
        #pragma omp simd
        for (int64_t j = 0; j < hidden; ++j) om[j] = (h[j] * inv) * c->weight[j];
    }
}

/* res_out = x + residual (residual may be NULL: then res_out is NULL and h = x);
   out = h * (1 / sqrt(mean(h^2) + eps)) * weight, row by row; rows strided, last dim contiguous */
void add_rms_norm(const float* x, int64_t ldx, const float* residual, int64_t ldr, const float* weight,
                  float eps, int64_t rows, int64_t hidden, float* out, int64_t ldo, float* res_out, int64_t ldro) {
    const struct norm_call c = {x, ldx, residual, ldr, weight, eps, hidden, out, ldo, res_out, ldro};
    gs_parallel_for(rows, rows * hidden < PARALLEL_FROM, norm_rows, (void*)&c);
}

struct silu_call { const float* y; int64_t ldy, inter; float* out; int64_t ldo; };

static void silu_rows(void* arg, int64_t begin, int64_t end) {
    const struct silu_call* c = (const struct silu_call*)arg;
    const int64_t inter = c->inter;
    for (int64_t m = begin; m < end; ++m) {
        const float* g = c->y + m * c->ldy;
        const float* u = g + inter;
        float* o = c->out + m * c->ldo;
        int64_t j = 0;
#if defined(GS_AVX512)
        const __m512 one = _mm512_set1_ps(1.f);
        for (; j + 16 <= inter; j += 16) {
            const __m512 gv = _mm512_loadu_ps(g + j);
            const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, gs_exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_storeu_ps(o + j, _mm512_mul_ps(s, _mm512_loadu_ps(u + j)));
        }
#elif defined(GS_AVX2)
        const __m256 one = _mm256_set1_ps(1.f);
        for (; j + 8 <= inter; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, gs_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
        }
#elif defined(GS_NEON)
        const float32x4_t one = vdupq_n_f32(1.f);
        for (; j + 4 <= inter; j += 4) {
            const float32x4_t gv = vld1q_f32(g + j);
            const float32x4_t s = vdivq_f32(gv, vaddq_f32(one, gs_exp4(vnegq_f32(gv))));
            vst1q_f32(o + j, vmulq_f32(s, vld1q_f32(u + j)));
        }
#endif
        for (; j < inter; ++j) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
}

/* out[m, j] = silu(y[m, j]) * y[m, inter + j], y rows strided [rows, 2 * inter] */
void silu_mul(const float* y, int64_t ldy, int64_t rows, int64_t inter, float* out, int64_t ldo) {
    const struct silu_call c = {y, ldy, inter, out, ldo};
    gs_parallel_for(rows, rows * inter < PARALLEL_FROM, silu_rows, (void*)&c);
}
