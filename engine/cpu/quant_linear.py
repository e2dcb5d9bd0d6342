"""The CPU backend's projections over GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), kept
quantized in memory: out = x @ W.T (+ bias) for float32 x [M, K], any M (a small C function,
built by engine/cpu/build.py, as engine/cpu/linear.py).

Layout (`pack_quantized`, once at load): the weight in panels of 16 output rows, as linear.py's
float32 panels, each panel one contiguous stream [its blocks' quants | their scales | their mins],
64-byte aligned. A block is 32 values of K for the 16 rows; its quants are laid out for VNNI's
vpdpbusd, which multiplies 4 unsigned bytes by 4 signed bytes per 32-bit lane: 16 rows x 4
consecutive K per 64 bytes. 8-bit quants are stored unsigned (Q8_0 + 128, Q6_K + 32, so that the
weight is vpdpbusd's unsigned operand); 4-bit ones two to a byte (low nibble: K 0-15 of the
block, high: K 16-31, as GGUF's Q4_0 blocks). Scales and mins are GGUF's float16 (Q8_0, Q4_0,
Q4_1: the same bytes per weight as the file) or float32 where GGUF's two-level scales are
multiplied out exactly (Q4_K: 6 bits per weight instead of 4.5; Q6_K: unpacked to 8 bits with
two float32 scales per block, 10 bits instead of 6.6: simple and exact, not yet the smallest).

The embedded model's 30 layers on the 2-core development machine (benchmarks/cpu_quant_bench.py,
best of 9, kinds interleaved; ms per pass, float32 panels / Q8_0 / Q4_0 / Q4_1): 1 row 16.9 / 5.4 /
3.5 / 3.9, 4 rows 18.4 / 6.8 / 4.5 / 5.2, 8 rows 20.4 / 7.8 / 5.6 / 6.5, 16 rows 23.9 / 10.7 / 8.2 / 9.1.

Activations are quantized per row and block of 32 to int8 with a float scale (llama.cpp's Q8
activations), and each block's products are summed exactly in int32 by vpdpbusd (64 products per
instruction), then scaled once per block in float32. The alternative, dequantizing the weight to
float32 in registers and one FMA per weight and row (exact activations), was slower at every row
count on the 2-core development machine (AVX-512 VNNI), Q4_1, the embedded model's 30 layers, best
of 9, interleaved: 1 row 6.3 ms against 4.2 here, 4 rows 7.0 / 5.6, 8 rows 8.9 / 7.0, 16 rows
14.9 / 9.6, 32 rows 28.7 / 15.6: unpacking costs ~7 instructions per 32 weights besides the FMAs.
The price: each activation moves by at most half its block's step (amax / 254), the error
llama.cpp's CPU path has too (~0.5% of the largest output on Gaussian data);
tests/test_quant_linear.py bounds it. On the embedded model (its Q4_1 projections and Q8_0 LM
head, teacher-forced over 1,024 tokens of docs/architecture.md) the next-token argmax agreed with
the float-activation path on the same weights at 95.6% of positions, mean KL 0.0036.

Prefill too: from 70 rows up this kernel beat torch's float32 F.linear (MKL) on the same shapes
(70 rows 30 ms against 65, 128 rows 53 / 94, 256 rows 103 / 165, Q4_0; int8 products run 4x as
many per instruction as float32 FMAs), so every row count takes it and nothing is dequantized
(benchmarks/cpu_quant_bench.py, benchmarks/results/cpu_quant_bench-cpu-2026-12-05.json).

Machines without AVX-512 VNNI take, by the compiler's feature macros, the same arithmetic (same
layout, same exact int32 block sums) on 256-bit registers with AVX-VNNI's vpdpbusd or AVX2's
vpmaddubsw + vpmaddwd, else in plain C (correct, not fast). Those builds on this machine (30
layers, best of 5, interleaved; 1 / 8 / 16 rows, ms): Q4_1 AVX-512 VNNI 3.9 / 6.3 / 10.0, AVX-VNNI
4.0 / 7.2 / 11.9, AVX2 3.8 / 8.8 / 14.9, plain C 14.2 / 53 / 99; Q8_0 4.7 / 8.2 / 11.3, 5.1 / 8.8 /
13.2, 5.7 / 10.6 / 17.8, 15.1 / 59 / 111.
`pack_quantized()` returns None where the kernel cannot be built (no compiler,
GRAPHSERVE_CPU_QUANT=torch): the caller keeps float weights.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass

import numpy as np
import torch

from graphserve.engine.cpu.build import CLibrary

PANEL, BLOCK = 16, 32
# GGUF type name -> the kernel's type code (the C enum below)
TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4}
# GGUF type name -> (values, bytes) of one of its blocks along K
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
# A converted GGUF folder's projection weights as the file's blocks (written by
# engine/model_files/gguf_import.py, read by engine/models/loader.py): uint8 [n, bytes per row] per
# tensor under the checkpoint's names; the file's metadata maps each name to its GGUF type.
# in a folder of its own: tools that load every top-level *.safetensors of a model folder (vLLM) must not see it
GGUF_BLOCKS_FILE = "gguf/blocks.safetensors"

_SOURCE = r"""
/* the instruction sets to use, read before any header: immintrin.h's target pragmas define the
   feature macros again (tests build with some of them taken away) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define USE_AVX512_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define USE_AVX2 1
#if defined(__AVXVNNI__)
#define USE_AVX_VNNI 1
#endif
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#define PANEL 16
#define QK 32
#define MAX_ROWS 16
/* bytes of quants ahead of the block in use to prefetch */
#define PREFETCH 2048

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

#if defined(USE_AVX512_VNNI)
#include <immintrin.h>
static inline __attribute__((always_inline)) __m512 load_scales(const int t, const uint8_t* p) {
    return (t == Q4_K || t == Q6_K) ? _mm512_loadu_ps(p) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
static inline __attribute__((always_inline)) __m512i bcast4(const int8_t* p) {
    int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v);
}
/* rows (<= 16) x 16 outputs of one panel: one float accumulator register per row; per block and
   row, 8 vpdpbusd into an int32 sum, then one scaled add (two with mins, two halves for Q6_K) */
static inline __attribute__((always_inline)) void block(const int t, const int rows, const int8_t* xq,
        int64_t k, const float* dx, const int32_t* sx, int64_t nb, const uint8_t* panel,
        const float* bias, float* out, int64_t ldo, int64_t valid) {
    const uint8_t* qs = panel;
    const uint8_t* sc = qs + nb * quant_bytes(t);
    const uint8_t* mn = sc + nb * scale_bytes(t);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MAX_ROWS];
    #pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* q = qs + b * quant_bytes(t);
        __m512i w[8];
        if (t == Q8_0 || t == Q6_K) {
            #pragma GCC unroll 8
            for (int g = 0; g < 8; ++g) {
                _mm_prefetch((const char*)(q + PREFETCH + 64 * g), _MM_HINT_T0);
                w[g] = _mm512_load_si512((const void*)(q + 64 * g));
            }
        } else {
            #pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                _mm_prefetch((const char*)(q + PREFETCH + 64 * c), _MM_HINT_T0);
                const __m512i v = _mm512_load_si512((const void*)(q + 64 * c));
                w[c] = _mm512_and_si512(v, low);
                w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        }
        const __m512 d = load_scales(t, sc + b * scale_bytes(t));
        const __m512 d2 = t == Q6_K ? _mm512_loadu_ps(sc + b * scale_bytes(t) + 64) : d;
        const __m512 mw = min_bytes(t) ? load_scales(t, mn + b * min_bytes(t)) : d;
        #pragma GCC unroll 16
        for (int m = 0; m < rows; ++m) {
            const int8_t* xb = xq + m * k + b * QK;
            const int64_t i = m * nb + b;
            const float dxm = dx[i];
            if (t == Q6_K) {  /* a scale per half block */
                __m512i s0 = _mm512_set1_epi32(-offset(t) * sx[2 * i]);
                __m512i s1 = _mm512_set1_epi32(-offset(t) * sx[2 * i + 1]);
                #pragma GCC unroll 4
                for (int g = 0; g < 4; ++g) {
                    s0 = _mm512_dpbusd_epi32(s0, w[g], bcast4(xb + 4 * g));
                    s1 = _mm512_dpbusd_epi32(s1, w[g + 4], bcast4(xb + 16 + 4 * g));
                }
                const __m512 x = _mm512_set1_ps(dxm);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d, x), acc[m]);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d2, x), acc[m]);
                continue;
            }
            __m512i s = _mm512_set1_epi32(-offset(t) * (sx[2 * i] + sx[2 * i + 1]));
            #pragma GCC unroll 8
            for (int g = 0; g < 8; ++g) s = _mm512_dpbusd_epi32(s, w[g], bcast4(xb + 4 * g));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dxm)), acc[m]);
            if (min_bytes(t))
                acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dxm * (float)(sx[2 * i] + sx[2 * i + 1])), acc[m]);
        }
    }
    const __mmask16 mask = valid >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) _mm512_mask_storeu_ps(out + m * ldo, mask, _mm512_add_ps(acc[m], bv));
}
#define KERNEL_PATH 0
#elif defined(USE_AVX2)
#include <immintrin.h>
static inline __attribute__((always_inline)) __m256 load_scales(const int t, const uint8_t* p) {
    return (t == Q4_K || t == Q6_K) ? _mm256_loadu_ps((const float*)p) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
static inline __attribute__((always_inline)) __m256i bcast4(const int8_t* p) {
    int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v);
}
#if defined(USE_AVX_VNNI)
#define SIGNED_Q8 0
static inline __attribute__((always_inline)) __m256i dot4(const int t, __m256i s, __m256i w, __m256i x) {
    (void)t; return _mm256_dpbusd_avx_epi32(s, w, x);
}
#define KERNEL_PATH 3
#else
/* vpdpbusd from vpmaddubsw (pairs, saturating at int16) and vpmaddwd: 4- and 6-bit quants stay below
   the bound (63 * 127 * 2); 8-bit ones are taken signed, |w| times x with w's sign (128 * 127 * 2) */
#define SIGNED_Q8 1
static inline __attribute__((always_inline)) __m256i dot4(const int t, __m256i s, __m256i w, __m256i x) {
    __m256i p;
    if (t == Q8_0) {
        const __m256i ws = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        p = _mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws));
    } else {
        p = _mm256_maddubs_epi16(w, x);
    }
    return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#define KERNEL_PATH 2
#endif
/* as the AVX-512 block, in two passes of 8 outputs (each the half of every 64 bytes that is theirs) */
static inline __attribute__((always_inline)) void block(const int t, const int rows, const int8_t* xq,
        int64_t k, const float* dx, const int32_t* sx, int64_t nb, const uint8_t* panel,
        const float* bias, float* out, int64_t ldo, int64_t valid) {
    const uint8_t* qs = panel;
    const uint8_t* sc = qs + nb * quant_bytes(t);
    const uint8_t* mn = sc + nb * scale_bytes(t);
    const int64_t half_scales = (t == Q4_K || t == Q6_K) ? 32 : 16;  /* bytes of 8 rows' scales */
    const int32_t off = (t == Q8_0 && SIGNED_Q8) ? 0 : offset(t);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2 && 8 * h < valid; ++h) {
        __m256 acc[MAX_ROWS];
        #pragma GCC unroll 16
        for (int m = 0; m < rows; ++m) acc[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* q = qs + b * quant_bytes(t) + 32 * h;
            __m256i w[8];
            if (t == Q8_0 || t == Q6_K) {
                #pragma GCC unroll 8
                for (int g = 0; g < 8; ++g) {
                    if (h == 0) _mm_prefetch((const char*)(q + PREFETCH + 64 * g), _MM_HINT_T0);
                    w[g] = _mm256_load_si256((const __m256i*)(q + 64 * g));
                }
            } else {
                #pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) {
                    if (h == 0) _mm_prefetch((const char*)(q + PREFETCH + 64 * c), _MM_HINT_T0);
                    const __m256i v = _mm256_load_si256((const __m256i*)(q + 64 * c));
                    w[c] = _mm256_and_si256(v, low);
                    w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
            }
            const uint8_t* sb = sc + b * scale_bytes(t) + half_scales * h;
            const __m256 d = load_scales(t, sb);
            const __m256 d2 = t == Q6_K ? _mm256_loadu_ps((const float*)(sb + 64)) : d;
            const __m256 mw = min_bytes(t) ? load_scales(t, mn + b * min_bytes(t) + half_scales * h) : d;
            #pragma GCC unroll 16
            for (int m = 0; m < rows; ++m) {
                const int8_t* xb = xq + m * k + b * QK;
                const int64_t i = m * nb + b;
                const __m256 x = _mm256_set1_ps(dx[i]);
                if (t == Q6_K) {
                    __m256i s0 = _mm256_set1_epi32(-off * sx[2 * i]), s1 = _mm256_set1_epi32(-off * sx[2 * i + 1]);
                    #pragma GCC unroll 4
                    for (int g = 0; g < 4; ++g) {
                        s0 = dot4(t, s0, w[g], bcast4(xb + 4 * g));
                        s1 = dot4(t, s1, w[g + 4], bcast4(xb + 16 + 4 * g));
                    }
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d, x), acc[m]);
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d2, x), acc[m]);
                    continue;
                }
                __m256i s = _mm256_set1_epi32(-off * (sx[2 * i] + sx[2 * i + 1]));
                #pragma GCC unroll 8
                for (int g = 0; g < 8; ++g) s = dot4(t, s, w[g], bcast4(xb + 4 * g));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, x), acc[m]);
                if (min_bytes(t))
                    acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(dx[i] * (float)(sx[2 * i] + sx[2 * i + 1])), acc[m]);
            }
        }
        const int64_t left = valid - 8 * h;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 bv = bias ? _mm256_maskload_ps(bias + 8 * h, mask) : _mm256_setzero_ps();
        #pragma GCC unroll 16
        for (int m = 0; m < rows; ++m) _mm256_maskstore_ps(out + m * ldo + 8 * h, mask, _mm256_add_ps(acc[m], bv));
    }
}
#else
static inline float scale_at(const int t, const uint8_t* p, int j) {
    if (t == Q4_K || t == Q6_K) { float f; memcpy(&f, p + 4 * j, 4); return f; }
    uint16_t h; memcpy(&h, p + 2 * j, 2); return half_to_float(h);
}
/* the same arithmetic in plain C: exact int32 block sums, then the same float steps */
static void block(const int t, const int rows, const int8_t* xq, int64_t k, const float* dx,
        const int32_t* sx, int64_t nb, const uint8_t* panel, const float* bias, float* out,
        int64_t ldo, int64_t valid) {
    const uint8_t* qs = panel;
    const uint8_t* sc = qs + nb * quant_bytes(t);
    const uint8_t* mn = sc + nb * scale_bytes(t);
    float acc[MAX_ROWS][PANEL] = {{0}};
    uint8_t w[QK][PANEL];
    float d[PANEL], d2[PANEL], mw[PANEL];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* q = qs + b * quant_bytes(t);
        for (int g = 0; g < 8; ++g)
            for (int j = 0; j < PANEL; ++j)
                for (int e = 0; e < 4; ++e) {
                    const uint8_t byte = (t == Q8_0 || t == Q6_K) ? q[g * 64 + j * 4 + e] : q[(g & 3) * 64 + j * 4 + e];
                    w[4 * g + e][j] = (t == Q8_0 || t == Q6_K) ? byte : g < 4 ? byte & 15 : byte >> 4;
                }
        for (int j = 0; j < PANEL; ++j) {
            d[j] = scale_at(t, sc + b * scale_bytes(t), j);
            d2[j] = t == Q6_K ? scale_at(t, sc + b * scale_bytes(t) + 64, j) : d[j];
            mw[j] = min_bytes(t) ? scale_at(t, mn + b * min_bytes(t), j) : 0.f;
        }
        for (int m = 0; m < rows; ++m) {
            const int8_t* xb = xq + m * k + b * QK;
            const int64_t i = m * nb + b;
            int32_t s0[PANEL], s1[PANEL];
            for (int j = 0; j < PANEL; ++j) { s0[j] = -offset(t) * sx[2 * i]; s1[j] = -offset(t) * sx[2 * i + 1]; }
            for (int kk = 0; kk < QK; ++kk) {
                const int32_t xv = xb[kk];
                int32_t* s = kk < QK / 2 ? s0 : s1;
                #pragma omp simd
                for (int j = 0; j < PANEL; ++j) s[j] += (int32_t)w[kk][j] * xv;
            }
            for (int j = 0; j < PANEL; ++j) {
                if (t == Q6_K) {
                    acc[m][j] += (float)s0[j] * (d[j] * dx[i]);
                    acc[m][j] += (float)s1[j] * (d2[j] * dx[i]);
                } else {
                    acc[m][j] += (float)(s0[j] + s1[j]) * (d[j] * dx[i]);
                    if (min_bytes(t)) acc[m][j] += mw[j] * (dx[i] * (float)(sx[2 * i] + sx[2 * i + 1]));
                }
            }
        }
    }
    for (int m = 0; m < rows; ++m)
        for (int j = 0; j < valid; ++j) out[m * ldo + j] = acc[m][j] + (bias ? bias[j] : 0.f);
}
#define KERNEL_PATH 1
#endif

/* which of the above this build took: 0 AVX-512 VNNI, 1 plain C, 2 AVX2, 3 AVX-VNNI (256-bit) */
int kernel_path(void) { return KERNEL_PATH; }

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

/* out[rows, n] (row stride ldo) = x[rows, k] (row stride ldx) @ W.T (+ bias), W as pack_quantized
   laid it out: panels of panel_stride bytes. */
void quant_linear(int type, const float* x, int64_t rows, int64_t ldx, const uint8_t* weight, int64_t n,
                  int64_t k, int64_t panel_stride, const float* bias, float* out, int64_t ldo) {
    const int64_t nb = k / QK, count = (n + PANEL - 1) / PANEL;
    int8_t* xq = (int8_t*)malloc((size_t)(rows * k));
    float* dx = (float*)malloc(sizeof(float) * (size_t)(rows * nb));
    int32_t* sx = (int32_t*)malloc(sizeof(int32_t) * 2 * (size_t)(rows * nb));
    void (*fn)(int, const int8_t*, int64_t, const float*, const int32_t*, int64_t, const uint8_t*,
               const float*, float*, int64_t, int64_t) =
        type == Q8_0 ? rows_q8_0 : type == Q4_0 ? rows_q4_0 : type == Q4_1 ? rows_q4_1
        : type == Q4_K ? rows_q4_k : rows_q6_k;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * nb; ++i)
            quantize_block(x + (i / nb) * ldx + (i % nb) * QK, xq + (i / nb) * k + (i % nb) * QK, dx + i, sx + 2 * i);
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < count; ++p) {
            const uint8_t* panel = weight + p * panel_stride;
            const int64_t valid = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
            const float* b = bias ? bias + p * PANEL : 0;
            for (int64_t m0 = 0; m0 < rows; m0 += MAX_ROWS)
                fn(rows - m0 < MAX_ROWS ? (int)(rows - m0) : MAX_ROWS, xq + m0 * k, k, dx + m0 * nb, sx + 2 * m0 * nb,
                   nb, panel, b, out + m0 * ldo + p * PANEL, ldo, valid);
        }
    }
    free(xq); free(dx); free(sx);
}

/* the activation quantization alone (for tests): xq [rows, k], dx [rows, k / 32] */
void quantize_rows(const float* x, int64_t rows, int64_t ldx, int64_t k, int8_t* xq, float* dx) {
    const int64_t nb = k / QK;
    int32_t sx[2];
    for (int64_t i = 0; i < rows * nb; ++i)
        quantize_block(x + (i / nb) * ldx + (i % nb) * QK, xq + (i / nb) * k + (i % nb) * QK, dx + i, sx);
}
"""

_i32, _i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_FUNCTIONS = {
    "quant_linear": ([_i32, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64], None),
    "quantize_rows": ([_ptr, _i64, _i64, _i64, _ptr, _ptr], None),
    "kernel_path": ([], _i32),
}
KERNEL_PATHS = {0: "AVX-512 VNNI", 1: "plain C", 2: "AVX2", 3: "AVX-VNNI"}
_LIBRARY = CLibrary("quant_linear", _SOURCE, _FUNCTIONS, disable_env="GRAPHSERVE_CPU_QUANT")
# The builds a machine with less than this one's instruction sets would take (the compiler's feature
# macros taken away), for the tests to check each gives the same numbers: name -> its library.
_WITHOUT = {"AVX-VNNI": ["__AVX512VNNI__"], "AVX2": ["__AVX512VNNI__", "__AVXVNNI__"],
            "plain C": ["__AVX512VNNI__", "__AVXVNNI__", "__AVX2__"]}
FALLBACK_LIBRARIES = {
    name: CLibrary(f"quant_linear_{name.replace(' ', '_').replace('-', '_').lower()}",
                   "".join(f"#undef {macro}\n" for macro in macros) + _SOURCE, _FUNCTIONS,
                   disable_env="GRAPHSERVE_CPU_QUANT")
    for name, macros in _WITHOUT.items()}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [n, k] weight in the kernel's layout: `panels` uint8 [ceil(n / 16), panel bytes]."""
    qtype: str  # the GGUF type name
    n: int
    k: int
    panels: torch.Tensor

    def __post_init__(self) -> None:
        # the kernel reads panels with aligned vector loads: a misaligned tensor would crash it
        if self.panels.data_ptr() % 64 or self.panels.stride(-1) != 1 or self.panels.dtype != torch.uint8:
            raise ValueError("quantized panels must be contiguous uint8 rows starting on a 64-byte boundary")

    @property
    def nbytes(self) -> int:
        return self.panels.numel()


def available() -> bool:
    return _LIBRARY.get() is not None


def _float_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype(np.float32)).view(np.uint8)


def _unpack(raw: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """GGUF blocks [n, bytes per row] -> (unsigned quants uint8 [n, k], scale fields as bytes [n,
    k / 32, bytes]: scales, then mins where the type has them)."""
    import gguf

    nb = k // BLOCK
    if qtype == "Q8_0":
        blocks = raw.reshape(n, nb, 34)
        return (blocks[..., 2:] ^ np.uint8(0x80)).reshape(n, k), [blocks[..., :2]]
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        blocks = raw.reshape(n, nb, head + 16)
        qs = blocks[..., head:]
        quants = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1).reshape(n, k)
        return quants, [blocks[..., :2]] if head == 2 else [blocks[..., :2], blocks[..., 2:4]]
    if qtype == "Q4_K":  # super-blocks of 256: 8 sub-blocks with 6-bit scales and mins
        blocks = raw.reshape(n * (k // 256), 144)
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        quants = (qs & np.uint8(15)).reshape(n, k)
        scales = (d * sc.astype(np.float32)).reshape(n, nb, 1)  # exact: 11-bit x 6-bit
        mins = (-dmin * mn.astype(np.float32)).reshape(n, nb, 1)
        return quants, [_float_bytes(scales), _float_bytes(mins)]
    if qtype == "Q6_K":  # super-blocks of 256: 16 sub-blocks of 16 with int8 scales
        blocks = raw.reshape(n * (k // 256), 210)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = blocks[:, 208:210].view(np.float16).astype(np.float32)
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        quants = (low.reshape(-1, 2, 4, 32) | (high << np.uint8(4))).reshape(n, k)
        scales = (d * sc).reshape(n, nb, 2, 1)  # exact: 11-bit x 8-bit; [first half, second half]
        return quants, [_float_bytes(scales).reshape(n, nb, 2, 4)]
    raise ValueError(f"no quantized kernel for {qtype}")


def pack_quantized(raw: np.ndarray | torch.Tensor, qtype: str, n: int, k: int) -> QuantizedWeight | None:
    """A GGUF tensor's bytes (uint8 [n, bytes per row], as gguf's reader gives them) for a weight
    [n, k], repacked for the kernel; None where the kernel does not apply (not built here, a type
    it lacks, k not a whole number of the type's blocks)."""
    if qtype not in TYPES or k % GGUF_BLOCKS[qtype][0] or _LIBRARY.get() is None:
        return None
    raw = np.ascontiguousarray(raw.numpy() if isinstance(raw, torch.Tensor) else raw).view(np.uint8).reshape(n, -1)
    quants, fields = _unpack(raw, qtype, n, k)
    count, nb = -(-n // PANEL), k // BLOCK
    pad = count * PANEL - n
    quants = np.pad(quants, ((0, pad), (0, 0))).reshape(count, PANEL, nb, BLOCK).transpose(0, 2, 1, 3)
    if qtype in ("Q8_0", "Q6_K"):  # [panel, block, group of 4 K, row, 4]
        qs = quants.reshape(count, nb, PANEL, 8, 4).transpose(0, 1, 3, 2, 4)
    else:  # bytes: low nibble K 0-15, high K 16-31; [panel, block, group, row, 4]
        qs = quants[..., :16] | (quants[..., 16:] << np.uint8(4))
        qs = qs.reshape(count, nb, PANEL, 4, 4).transpose(0, 1, 3, 2, 4)
    parts = [np.ascontiguousarray(qs).reshape(count, -1)]
    for field in fields:  # [n, nb, (halves,) bytes] -> [panel, block, (halves,) row, bytes]
        field = np.pad(field.reshape(n, nb, -1, field.shape[-1]), ((0, pad), (0, 0), (0, 0), (0, 0)))
        parts.append(np.ascontiguousarray(field.reshape(count, PANEL, nb, *field.shape[2:]).transpose(0, 2, 3, 1, 4))
                     .reshape(count, -1))
    stride = -(-sum(p.shape[1] for p in parts) // 64) * 64
    panels = torch.zeros((count, stride), dtype=torch.uint8)
    panels[:, :sum(p.shape[1] for p in parts)] = torch.from_numpy(np.concatenate(parts, axis=1))
    return QuantizedWeight(qtype, n, k, panels)


def applies(x: torch.Tensor, weight: QuantizedWeight | None) -> bool:
    return (weight is not None and x.dim() == 2 and x.shape[0] >= 1 and x.shape[1] == weight.k
            and x.dtype == torch.float32 and x.stride(-1) == 1)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 library: CLibrary = _LIBRARY) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, n] float32, the activations quantized per row and block of 32
    (the module docstring); the caller checked applies()."""
    lib = library.get()
    rows = x.shape[0]
    assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32)
    out = torch.empty((rows, weight.n), dtype=torch.float32)
    lib.quant_linear(TYPES[weight.qtype], x.data_ptr(), rows, x.stride(0), weight.panels.data_ptr(), weight.n,
                     weight.k, weight.panels.shape[1], None if bias is None else bias.data_ptr(), out.data_ptr(),
                     weight.n)
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own quantization of x [M, K] (float32, rows contiguous): (int8 [M, K], float32
    scales [M, K / 32]), so that x ~ xq * scale per block."""
    lib = _LIBRARY.get()
    rows, k = x.shape
    xq, dx = torch.empty((rows, k), dtype=torch.int8), torch.empty((rows, k // BLOCK), dtype=torch.float32)
    lib.quantize_rows(x.data_ptr(), rows, x.stride(0), k, xq.data_ptr(), dx.data_ptr())
    return xq, dx


if __name__ == "__main__":  # build it now (e.g. in a Docker image) and say whether it works
    logging.basicConfig(level=logging.INFO)
    lib = _LIBRARY.get()
    print("CPU quantized linear:", "unavailable" if lib is None else KERNEL_PATHS[lib.kernel_path()], file=sys.stderr)
