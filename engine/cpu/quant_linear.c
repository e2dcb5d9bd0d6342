/* The CPU backend's projections over GGUF-quantized weights (engine/cpu/quant_linear.py, which
   describes the layout): out = x @ W.T (+ bias) for float32 x [M, K], activations quantized per row
   and block of 32 to int8, each block's products summed exactly in int32. The panel block comes
   from the widest path this build has: AVX-512 VNNI, AVX-VNNI or AVX2, NEON (with dotprod or
   i8mm), else plain C. */
#include "isa.h"
#include "parallel.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#define PANEL 16
#define QK 32
#define MAX_ROWS 16
/* bytes of quants ahead of the block in use to prefetch */
#define PREFETCH 2048
/* blocks of activations from which their quantization is a parallel loop of its own */
#define QUANTIZE_PARALLEL_FROM 256

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4 };

/* per (panel, block): bytes of quants, of scales, of mins */
static inline int64_t quant_bytes(int t) { return (t == Q8_0 || t == Q6_K) ? 512 : 256; }
static inline int64_t scale_bytes(int t) { return t == Q6_K ? 128 : t == Q4_K ? 64 : 32; }
static inline int64_t min_bytes(int t) { return t == Q4_1 ? 32 : t == Q4_K ? 64 : 0; }
/* the unsigned quant's zero: dot(q - offset, x) = dot(q, x) - offset * sum(x) */
static inline int32_t offset(int t) { return t == Q8_0 ? 128 : t == Q4_0 ? 8 : t == Q6_K ? 32 : 0; }

/* x [rows, k] (row stride ldx) -> xq int8 [rows, k], dx [rows, nb] (scale), sx [rows, nb, 2] (sums
   of each half block's quants). Round to nearest: |x - dx * xq| <= dx / 2. */
static void quantize_block(const float* x, int8_t* xq, float* dx, int32_t* sx) {
    float amax = 0.f;
    #pragma omp simd reduction(max:amax)
    for (int i = 0; i < QK; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int32_t s0 = 0, s1 = 0;
    #pragma omp simd reduction(+:s0)
    for (int i = 0; i < QK / 2; ++i) { xq[i] = (int8_t)lrintf(x[i] * id); s0 += xq[i]; }
    #pragma omp simd reduction(+:s1)
    for (int i = QK / 2; i < QK; ++i) { xq[i] = (int8_t)lrintf(x[i] * id); s1 += xq[i]; }
    *dx = d; sx[0] = s0; sx[1] = s1;
}

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float f;
    if (exp == 0) { f = ldexpf((float)man, -24); return sign ? -f : f; }
    uint32_t bits = sign | ((exp == 31 ? 255 : exp - 15 + 127) << 23) | (man << 13);
    memcpy(&f, &bits, 4);
    return f;
}


#if defined(GS_AVX512_VNNI)
#include "quant_linear_avx512.h"
#elif defined(GS_AVX2)
#include "quant_linear_avx2.h"
#elif defined(GS_NEON)
#include "quant_linear_neon.h"
#else
#include "quant_linear_generic.h"
#endif
const char* gs_isa(void) { return GS_QUANT_PATH; }

#define CASE(T, R) case R: block(T, R, xm, k, dxm, sxm, nb, panel, b, om, ldo, valid); break;
#define DISPATCH(NAME, T) \
static void NAME(int rows, const int8_t* xm, int64_t k, const float* dxm, const int32_t* sxm, int64_t nb, \
                 const uint8_t* panel, const float* b, float* om, int64_t ldo, int64_t valid) { \
    switch (rows) { \
    CASE(T, 1) CASE(T, 2) CASE(T, 3) CASE(T, 4) CASE(T, 5) CASE(T, 6) CASE(T, 7) CASE(T, 8) \
    CASE(T, 9) CASE(T, 10) CASE(T, 11) CASE(T, 12) CASE(T, 13) CASE(T, 14) CASE(T, 15) CASE(T, 16) \
    } \
}
DISPATCH(rows_q8_0, Q8_0)
DISPATCH(rows_q4_0, Q4_0)
DISPATCH(rows_q4_1, Q4_1)
DISPATCH(rows_q4_k, Q4_K)
DISPATCH(rows_q6_k, Q6_K)

struct quant_call {
    int type;
    const float* x;
    int64_t rows, ldx;
    const uint8_t* weight;
    int64_t n, k, nb, panel_stride;
    const float* bias;
    float* out;
    int64_t ldo;
    int8_t* xq;
    float* dx;
    int32_t* sx;
};

static void quantize_range(void* arg, int64_t begin, int64_t end) {
    const struct quant_call* c = (const struct quant_call*)arg;
    const int64_t nb = c->nb;
    for (int64_t i = begin; i < end; ++i)
        quantize_block(c->x + (i / nb) * c->ldx + (i % nb) * QK, c->xq + (i / nb) * c->k + (i % nb) * QK, c->dx + i,
                       c->sx + 2 * i);
}

static void panel_range(void* arg, int64_t begin, int64_t end) {
    const struct quant_call* c = (const struct quant_call*)arg;
    const int t = c->type;
    void (*fn)(int, const int8_t*, int64_t, const float*, const int32_t*, int64_t, const uint8_t*,
               const float*, float*, int64_t, int64_t) =
        t == Q8_0 ? rows_q8_0 : t == Q4_0 ? rows_q4_0 : t == Q4_1 ? rows_q4_1 : t == Q4_K ? rows_q4_k : rows_q6_k;
    for (int64_t p = begin; p < end; ++p) {
        const uint8_t* panel = c->weight + p * c->panel_stride;
        const int64_t valid = c->n - p * PANEL < PANEL ? c->n - p * PANEL : PANEL;
        const float* b = c->bias ? c->bias + p * PANEL : 0;
        for (int64_t m0 = 0; m0 < c->rows; m0 += MAX_ROWS)
            fn(c->rows - m0 < MAX_ROWS ? (int)(c->rows - m0) : MAX_ROWS, c->xq + m0 * c->k, c->k, c->dx + m0 * c->nb,
               c->sx + 2 * m0 * c->nb, c->nb, panel, b, c->out + m0 * c->ldo + p * PANEL, c->ldo, valid);
    }
}

/* out[rows, n] (row stride ldo) = x[rows, k] (row stride ldx) @ W.T (+ bias), W as pack_quantized
   laid it out: panels of panel_stride bytes. */
void quant_linear(int type, const float* x, int64_t rows, int64_t ldx, const uint8_t* weight, int64_t n,
                  int64_t k, int64_t panel_stride, const float* bias, float* out, int64_t ldo) {
    const int64_t nb = k / QK;
    struct quant_call c = {type, x, rows, ldx, weight, n, k, nb, panel_stride, bias, out, ldo,
                           (int8_t*)malloc((size_t)(rows * k)), (float*)malloc(sizeof(float) * (size_t)(rows * nb)),
                           (int32_t*)malloc(sizeof(int32_t) * 2 * (size_t)(rows * nb))};
    /* a decode step's few rows quantize in a few microseconds: a parallel loop would cost as much */
    gs_parallel_for(rows * nb, rows * nb < QUANTIZE_PARALLEL_FROM, quantize_range, &c);
    gs_parallel_for((n + PANEL - 1) / PANEL, 0, panel_range, &c);
    free(c.xq); free(c.dx); free(c.sx);
}

/* the activation quantization alone (for tests): xq [rows, k], dx [rows, k / 32] */
void quantize_rows(const float* x, int64_t rows, int64_t ldx, int64_t k, int8_t* xq, float* dx) {
    const int64_t nb = k / QK;
    int32_t sx[2];
    for (int64_t i = 0; i < rows * nb; ++i)
        quantize_block(x + (i / nb) * ldx + (i % nb) * QK, xq + (i / nb) * k + (i % nb) * QK, dx + i, sx);
}
