/* The product a LoRA adapter adds to a projection on the CPU (engine/cpu/lora.py; decoder.c calls it
   after each projection of the decode stack): for each row with an adapter slot s and each slice j of
   the output where the adapter's rank r = ranks[s, j] > 0,
       u = A[s, j, :r, :] @ x[row]                        (r dot products of length `in`)
       y[row, slice j] += (B[s, slice j, :r] @ u) * scale[s]
   in peft's order (lora_B(lora_A(x)) * scaling, then added), u rounded to float32 as peft's lora_A
   output is. Every number of a row comes from the same dot products in the same order whatever the
   other rows are, so a row's tokens do not depend on its batch mates or on the batch size: the work is
   split between threads by (row, slice), never inside a sum. One parallel loop a call: two (every
   row's A @ x, then B @ u over blocks of columns, a finer split) measured no faster on 2 cores (0.73-0.77x
   the base model's tok/s against 0.69-0.75x, 32 requests over 8 adapters in process), and where OpenMP's
   threads sleep between loops (more threads than cores) each loop pays their wake-up. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "isa.h"
#include "lora.h"
#include "parallel.h"

#include <stdint.h>
#include <stdlib.h>

const char* gs_isa(void) { return GS_ISA_NAME; }

/* floats of adapter weights a call reads below which it runs in the caller's thread */
#define PARALLEL_FROM 65536

/* sum of a[i] * b[i], i < n: one fixed order for a given n (lanes of a few vector accumulators, then
   their tree, then the tail), whatever the pointers' alignment. AVX2 (AVX-512 builds too: 512-bit
   registers measured no faster, the products wait on memory); elsewhere plain C, which the compiler
   vectorizes (1.6x slower than AVX2 with x86's baseline SSE2, one thread, the embedded model's shapes). */
static inline float dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
#if defined(GS_AVX2)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float tail = 0.f;
    for (; i < n; ++i) tail += a[i] * b[i];
    return _mm_cvtss_f32(h) + tail;
#else
    float lanes[16] = {0};
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) lanes[j] += a[i + j] * b[i + j];
    for (int j = 0; i < n; ++i, ++j) lanes[j] += a[i] * b[i];
    for (int w = 8; w; w >>= 1)  /* a tree: no chain of 16 dependent adds */
        for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
    return lanes[0];
#endif
}

#if defined(GS_AVX2)
/* the 8 sums b[c * ldb + k] * u[k] over k < r for c < 8 (8 columns of B): dot()'s lanes and tree for each
   column's products, its 8 sums transposed into one register by pairwise adds */
static inline __m256 dot8(const float* b, int64_t ldb, const float* u, int64_t r) {
    __m256 acc[8];
    #pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= r; k += 8) {
        const __m256 uv = _mm256_loadu_ps(u + k);
        #pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(b + c * ldb + k), uv, acc[c]);
    }
    if (k < r) {
        static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
        const __m256i mask = _mm256_loadu_si256((const __m256i*)(lanes + 8 - (r - k)));
        const __m256 uv = _mm256_maskload_ps(u + k, mask);
        #pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(_mm256_maskload_ps(b + c * ldb + k, mask), uv, acc[c]);
    }
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}
#endif

struct call {
    const struct lora_projection* p;
    const int32_t* slots;
    const int64_t* active;  /* the rows with an adapter */
    const float* x;
    int64_t ldx;
    float* y;
    int64_t ldy;
    float* u;  /* [active rows, slices, rank_dim] */
};

static inline int64_t rank_of(const struct lora_projection* p, int64_t slot, int64_t j) {
    const int64_t r = p->ranks[slot * p->slices + j];
    return r < 0 ? 0 : r > p->rank_dim ? p->rank_dim : r;
}

/* u[i, j, :r] = A[s, j, :r, :] @ x[row] for active row i and slice j */
static void shrink(const struct call* c, int64_t i, int64_t j, int64_t r) {
    const struct lora_projection* p = c->p;
    const int64_t row = c->active[i], slot = c->slots[row];
    const float* a = p->a + slot * p->a_s0 + j * p->rank_dim * p->in;
    const float* x = c->x + row * c->ldx;
    float* u = c->u + (i * p->slices + j) * p->rank_dim;
    for (int64_t k = 0; k < r; ++k) u[k] = dot(a + k * p->in, x, p->in);
}

/* y[row, first:last] (slice j's columns) += (B[s, first:last, :r] @ u[i, j]) * scale: 8 columns at a time
   from the slice's first (AVX2), then one by one */
static void expand(const struct call* c, int64_t i, int64_t j, int64_t r, int64_t first, int64_t last) {
    const struct lora_projection* p = c->p;
    const int64_t row = c->active[i], slot = c->slots[row];
    const float scale = p->scales[slot];
    const float* b = p->b + slot * p->b_s0;
    const float* u = c->u + (i * p->slices + j) * p->rank_dim;
    float* y = c->y + row * c->ldy;
    int64_t col = first;
#if defined(GS_AVX2)
    const __m256 sv = _mm256_set1_ps(scale);
    for (; col + 8 <= last; col += 8) {
        const __m256 d = dot8(b + col * p->rank_dim, p->rank_dim, u, r);
        _mm256_storeu_ps(y + col, _mm256_add_ps(_mm256_loadu_ps(y + col), _mm256_mul_ps(d, sv)));
    }
#endif
    for (; col < last; ++col)  /* two roundings, as peft's (B @ u) * scaling, then the add */
        y[col] += dot(b + col * p->rank_dim, u, r) * scale;
}

/* per (active row, slice): its u, then its columns */
static void row_slices(void* arg, int64_t begin, int64_t end) {
    const struct call* c = (const struct call*)arg;
    const struct lora_projection* p = c->p;
    for (int64_t t = begin; t < end; ++t) {
        const int64_t i = t / p->slices, j = t % p->slices, r = rank_of(p, c->slots[c->active[i]], j);
        if (!r) continue;
        int64_t first = 0;
        for (int64_t q = 0; q < j; ++q) first += p->slice_size[q];
        shrink(c, i, j, r);
        expand(c, i, j, r, first, first + p->slice_size[j]);
    }
}

void lora_add(const struct lora_projection* p, const int32_t* slots, int64_t rows, const float* x, int64_t ldx,
              float* y, int64_t ldy) {
    int64_t out = 0, count = 0;
    for (int64_t j = 0; j < p->slices; ++j) out += p->slice_size[j];
    int64_t* active = (int64_t*)malloc(sizeof(int64_t) * (rows > 0 ? rows : 1));
    for (int64_t row = 0; row < rows; ++row)
        if (slots[row] >= 0 && slots[row] < p->slots) active[count++] = row;
    if (count) {
        float* u = (float*)malloc(sizeof(float) * count * p->slices * p->rank_dim);
        const struct call c = {p, slots, active, x, ldx, y, ldy, u};
        const int serial = count * p->rank_dim * (p->slices * p->in + out) < PARALLEL_FROM;
        gs_parallel_for(count * p->slices, serial, row_slices, (void*)&c);
        free(u);
    }
    free(active);
}
