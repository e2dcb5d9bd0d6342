"""Paged decode attention for the CPU backend, reading each sequence's KV blocks where they
lie (no gathered copy, no padding to the longest row, no mask): a small C function (built
by engine/cpu/build.py), one sequence at a time, its blocks read whole and in order (one
(sequence, KV head) pair at a time when there are few sequences).

`paged_decode_attention()` returns None where it does not apply (no compiler, not float32,
GRAPHSERVE_CPU_ATTENTION=torch), and the caller falls back to gather + SDPA. Results agree
with scaled_dot_product_attention to float32 rounding (a different summation order)."""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

from graphserve.engine.cpu.build import AVX512_EXP16, CLibrary

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* out[b, h*G + g, :] = softmax_t(scale * q[b, h*G + g, :] . K[b, t, h, :]) @ V[b, t, h, :]
   over t < context_lens[b], token t of row b at block block_tables[b, t / bs], offset t % bs.
   q and out: [B, Hq, D] with strides (q_s0, q_s1, 1) and (Hq * D, D, 1);
   caches: [num_blocks, bs, Hkv, D] contiguous. */
#if defined(__AVX512F__)
#include <immintrin.h>
""" + AVX512_EXP16 + r"""
/* sh[0:L] <- exp(sh - max(sh)); returns 1 / their sum */
static inline float softmax16(float* sh, int64_t L) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= L; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sh + t));
    const __mmask16 tail = (__mmask16)((1u << (L - t)) - 1);
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, sh + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sv = _mm512_setzero_ps();
    for (t = 0; t + 16 <= L; t += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + t), m));
        _mm512_storeu_ps(sh + t, e);
        sv = _mm512_add_ps(sv, e);
    }
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sh + t), m)));
    _mm512_mask_storeu_ps(sh + t, tail, e);
    return 1.f / _mm512_reduce_add_ps(_mm512_add_ps(sv, e));
}
/* One (sequence, KV head) task with head_dim 16 * NV, its G query heads in register blocks of GS:
   each K and V row is loaded once per block and used for every head of the block; the query
   (scaled) and the output accumulators stay in registers across the whole context. */
#define DEFINE_TASK(NV, GS)                                                                          \
static void task_##NV(const float* qb, int64_t q_s1, const float* k_cache, const float* v_cache,     \
                      const int32_t* table, int64_t L, int64_t h, int64_t G, int64_t bs,             \
                      int64_t tok_s, int64_t blk_s, float scale, float* scores, float* outb) {       \
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
            for (int64_t o = 0; o < n; ++o) {                                                        \
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
        for (int g = 0; g < gn; ++g) inv[g] = softmax16(scores + (g0 + g) * L, L);                   \
        for (int64_t t0 = 0; t0 < L; t0 += bs) {                                                     \
            const float* vb = v_cache + (int64_t)table[t0 / bs] * blk_s + h * 16 * NV;               \
            const int64_t n = L - t0 < bs ? L - t0 : bs;                                             \
            for (int64_t o = 0; o < n; ++o) {                                                        \
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
DEFINE_TASK(4, 4)  /* head_dim 64: 16 + 16 registers */
DEFINE_TASK(8, 2)  /* head_dim 128 */
#endif

void paged_decode(const float* q, int64_t q_s0, int64_t q_s1, const float* k_cache, const float* v_cache,
                  const int32_t* block_tables, int64_t bt_s0, const int32_t* context_lens,
                  float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale,
                  int64_t split_heads) {
    /* one task per sequence (its blocks read whole, in order), or with split_heads (few rows)
       per (sequence, KV head) */
    const int64_t G = Hq / Hkv, tok_s = Hkv * D, blk_s = bs * Hkv * D;
    const int64_t per_row = split_heads ? Hkv : 1, heads = split_heads ? 1 : Hkv;
    #pragma omp parallel
    {
        float* scores = NULL;
        int64_t cap = 0;
        float* acc = (float*)malloc(sizeof(float) * Hq * D);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * per_row; ++task) {
            const int64_t b = task / per_row, h0 = (task % per_row) * heads, h1 = h0 + heads;
            const int64_t L = context_lens[b];
            if (Hq * L > cap) {
                free(scores);
                cap = Hq * L;
                scores = (float*)malloc(sizeof(float) * cap);
            }
            const float* qb = q + b * q_s0;
            const int32_t* table = block_tables + b * bt_s0;
#if defined(__AVX512F__)
            if (D == 64 || D == 128) {
                for (int64_t h = h0; h < h1; ++h) {
                    if (D == 64)
                        task_4(qb, q_s1, k_cache, v_cache, table, L, h, G, bs, tok_s, blk_s, scale, scores, out + b * Hq * D);
                    else
                        task_8(qb, q_s1, k_cache, v_cache, table, L, h, G, bs, tok_s, blk_s, scale, scores, out + b * Hq * D);
                }
                continue;
            }
#endif
            for (int64_t t0 = 0; t0 < L; t0 += bs) {
                const float* kb = k_cache + (int64_t)table[t0 / bs] * blk_s;
                const int64_t n = L - t0 < bs ? L - t0 : bs;
                for (int64_t o = 0; o < n; ++o) {
                    for (int64_t h = h0; h < h1; ++h) {
                        const float* k = kb + o * tok_s + h * D;
                        for (int64_t hq = h * G; hq < (h + 1) * G; ++hq) {
                            const float* qh = qb + hq * q_s1;
                            float s = 0.f;
                            #pragma omp simd reduction(+:s)
                            for (int64_t d = 0; d < D; ++d) s += qh[d] * k[d];
                            scores[hq * L + t0 + o] = s * scale;
                        }
                    }
                }
            }
            for (int64_t hq = h0 * G; hq < h1 * G; ++hq) {
                float* sh = scores + hq * L;
                float m = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < L; ++t) m = sh[t] > m ? sh[t] : m;
                #pragma omp simd reduction(+:sum)
                for (int64_t t = 0; t < L; ++t) { sh[t] = expf(sh[t] - m); sum += sh[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < L; ++t) sh[t] *= inv;
            }
            memset(acc + h0 * G * D, 0, sizeof(float) * (h1 - h0) * G * D);
            for (int64_t t0 = 0; t0 < L; t0 += bs) {
                const float* vb = v_cache + (int64_t)table[t0 / bs] * blk_s;
                const int64_t n = L - t0 < bs ? L - t0 : bs;
                for (int64_t o = 0; o < n; ++o) {
                    for (int64_t h = h0; h < h1; ++h) {
                        const float* v = vb + o * tok_s + h * D;
                        for (int64_t hq = h * G; hq < (h + 1) * G; ++hq) {
                            const float p = scores[hq * L + t0 + o];
                            float* a = acc + hq * D;
                            #pragma omp simd
                            for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
                        }
                    }
                }
            }
            memcpy(out + (b * Hq + h0 * G) * D, acc + h0 * G * D, sizeof(float) * (h1 - h0) * G * D);
        }
        free(scores);
        free(acc);
    }
}
"""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_LIBRARY = CLibrary("paged_decode", _SOURCE, {"paged_decode": (
    [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64],
    None)}, disable_env="GRAPHSERVE_CPU_ATTENTION")


def available() -> bool:
    return _LIBRARY.get() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor | None:
    """q [B, Hq, D] (last dim contiguous); caches [N, block_size, Hkv, D]; block_tables [B, W]
    int32; context_lens [B] int32 (each >= 1). Returns [B, Hq, D], or None (caller falls back)."""
    if (q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu"
            or q.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32
            or block_tables.stride(1) != 1 or not context_lens.is_contiguous()):
        return None
    lib = _LIBRARY.get()
    if lib is None:
        return None
    batch, num_heads, head_dim = q.shape
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype)
    lib.paged_decode(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                     block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(),
                     batch, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale,
                     int(batch < 2 * torch.get_num_threads()))
    return out


if __name__ == "__main__":  # build it now (e.g. in a Docker image) and say whether it works
    logging.basicConfig(level=logging.INFO)
    print("CPU decode attention:", "built" if available() else "unavailable", file=sys.stderr)
