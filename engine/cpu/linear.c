/* The CPU backend's decode-sized float32 projections (engine/cpu/linear.py): out = x @ W.T + bias
   over a weight repacked once into panels of 16 output rows, [ceil(N / 16), K, 16], so that a
   block of rows takes each weight vector once, in one streaming pass, with a software prefetch
   ahead of it. */
#include "isa.h"
#include "parallel.h"

#include <stdint.h>

#define PANEL 16
/* Floats of the panel ahead of the one in use to prefetch: 4 KB, the best of 0-16 KB on the
   development machine (the first pass over the weights ran 20-40% slower without). */
#define PREFETCH 1024

#if defined(GS_AVX512)
#include "linear_avx512.h"
#elif defined(GS_AVX2)
#include "linear_avx2.h"
#elif defined(GS_NEON)
#include "linear_neon.h"
#else
#define GS_LINEAR_ROWS 16
static void block(int rows, const float* x, int64_t ldx, const float* panel, int64_t k,
                  const float* bias, float* out, int64_t ldo, int64_t valid) {
    float acc[GS_LINEAR_ROWS][PANEL] = {{0}};
    for (int64_t kk = 0; kk < k; ++kk)
        for (int m = 0; m < rows; ++m) {
            const float xv = x[m * ldx + kk];
            #pragma omp simd
            for (int j = 0; j < PANEL; ++j) acc[m][j] += xv * panel[kk * PANEL + j];
        }
    for (int m = 0; m < rows; ++m)
        for (int j = 0; j < valid; ++j) out[m * ldo + j] = acc[m][j] + (bias ? bias[j] : 0.f);
}
#endif
const char* gs_isa(void) { return GS_ISA_NAME; }

struct pack_call { const float* w; int64_t n, k; float* panels; };

static void pack_range(void* arg, int64_t begin, int64_t end) {
    const struct pack_call* c = (const struct pack_call*)arg;
    for (int64_t p = begin; p < end; ++p)
        for (int64_t kk = 0; kk < c->k; ++kk)
            for (int64_t j = 0; j < PANEL; ++j) {
                const int64_t row = p * PANEL + j;
                c->panels[(p * c->k + kk) * PANEL + j] = row < c->n ? c->w[row * c->k + kk] : 0.f;
            }
}

void pack_panels(const float* w, int64_t n, int64_t k, float* panels) {
    const struct pack_call c = {w, n, k, panels};
    gs_parallel_for((n + PANEL - 1) / PANEL, 0, pack_range, (void*)&c);
}

#define CASE(R) case R: block(R, xm, c->ldx, panel, c->k, b, om, c->ldo, valid); break;

struct linear_call {
    const float* x;
    int64_t rows, ldx;
    const float* panels;
    int64_t n, k;
    const float* bias;
    float* out;
    int64_t ldo;
};

static void linear_range(void* arg, int64_t begin, int64_t end) {
    const struct linear_call* c = (const struct linear_call*)arg;
    for (int64_t p = begin; p < end; ++p) {
        const float* panel = c->panels + p * c->k * PANEL;
        const int64_t valid = c->n - p * PANEL < PANEL ? c->n - p * PANEL : PANEL;
        const float* b = c->bias ? c->bias + p * PANEL : 0;
        for (int64_t m0 = 0; m0 < c->rows; m0 += GS_LINEAR_ROWS) {
            const float* xm = c->x + m0 * c->ldx;
            float* om = c->out + m0 * c->ldo + p * PANEL;
            switch (c->rows - m0 < GS_LINEAR_ROWS ? c->rows - m0 : GS_LINEAR_ROWS) {
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#if GS_LINEAR_ROWS > 6
            CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#endif
            }
        }
    }
}

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) @ W.T (+ bias), W as pack_panels made it */
void panel_linear(const float* x, int64_t rows, int64_t ldx, const float* panels, int64_t n, int64_t k,
                  const float* bias, float* out, int64_t ldo) {
    const struct linear_call c = {x, rows, ldx, panels, n, k, bias, out, ldo};
    gs_parallel_for((n + PANEL - 1) / PANEL, 0, linear_range, (void*)&c);
}
