"""The CPU backend's decode-sized projections (1 to 32 rows, float32): out = x @ W.T + bias over
a weight repacked once at load into panels of 16 output rows, [ceil(N / 16), K, 16], so that
the whole batch's rows take each weight vector once, in one streaming pass over the weight, with a
software prefetch ahead of it (a small C function, built by engine/cpu/build.py).

Why not oneDNN or MKL: at these batch sizes a decode step is bound by reading the weights from
memory, and both libraries either re-read the weight per block of rows or leave the memory
idle while they compute. The embedded model's 30 layers on the 2-core development machine
(benchmarks/cpu_linear_bench.py, best of 7): at 16 rows 25.5 ms here, 34.8 with oneDNN's packed
weight, 46.8 with MKL; at 4 rows 18.6 / 24.6 / 30.2; at 1 row 21.0 / 27.2 / 21.8 (MKL's
matrix-vector path). From 64 rows (prefill) the libraries win: 109 ms here against 98 (oneDNN).

`linear()` returns None where it does not apply (no compiler, GRAPHSERVE_CPU_LINEAR=torch), and
the caller falls back to torch. Results equal x @ W.T to float32 rounding (one sum per output,
in order of K)."""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

from graphserve.engine.cpu.build import CLibrary

PANEL = 16

_SOURCE = r"""
#include <stdint.h>
#define PANEL 16
#define MAX_ROWS 16
/* Floats of the panel ahead of the one in use to prefetch: 4 KB, the best of 0-16 KB on the
   development machine (the first pass over the weights ran 20-40% slower without). */
#define PREFETCH 1024

void pack_panels(const float* w, int64_t n, int64_t k, float* panels) {
    const int64_t count = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; ++p)
        for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t j = 0; j < PANEL; ++j) {
                const int64_t row = p * PANEL + j;
                panels[(p * k + kk) * PANEL + j] = row < n ? w[row * k + kk] : 0.f;
            }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* rows (<= 16) x 16 outputs: one accumulator register per row */
static inline __attribute__((always_inline)) void block(const int rows, const float* x, int64_t ldx,
        const float* panel, int64_t k, const float* bias, float* out, int64_t ldo, int64_t valid) {
    __m512 acc[MAX_ROWS];
    #pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; ++kk) {
        _mm_prefetch((const char*)(panel + kk * PANEL + PREFETCH), _MM_HINT_T0);
        const __m512 w = _mm512_loadu_ps(panel + kk * PANEL);
        #pragma GCC unroll 16
        for (int m = 0; m < rows; ++m) acc[m] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m * ldx + kk]), acc[m]);
    }
    const __mmask16 mask = valid >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    #pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) _mm512_mask_storeu_ps(out + m * ldo, mask, _mm512_add_ps(acc[m], b));
}
#define CASE(R) case R: block(R, xm, ldx, panel, k, b, om, ldo, valid); break;
#else
static void block_generic(int rows, const float* x, int64_t ldx, const float* panel, int64_t k,
                          const float* bias, float* out, int64_t ldo, int64_t valid) {
    float acc[MAX_ROWS][PANEL] = {{0}};
    for (int64_t kk = 0; kk < k; ++kk)
        for (int m = 0; m < rows; ++m) {
            const float xv = x[m * ldx + kk];
            #pragma omp simd
            for (int j = 0; j < PANEL; ++j) acc[m][j] += xv * panel[kk * PANEL + j];
        }
    for (int m = 0; m < rows; ++m)
        for (int j = 0; j < valid; ++j) out[m * ldo + j] = acc[m][j] + (bias ? bias[j] : 0.f);
}
#define CASE(R) case R: block_generic(R, xm, ldx, panel, k, b, om, ldo, valid); break;
#endif

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) @ W.T (+ bias), W as pack_panels made it */
void panel_linear(const float* x, int64_t rows, int64_t ldx, const float* panels, int64_t n, int64_t k,
                  const float* bias, float* out, int64_t ldo) {
    const int64_t count = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; ++p) {
        const float* panel = panels + p * k * PANEL;
        const int64_t valid = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        const float* b = bias ? bias + p * PANEL : 0;
        for (int64_t m0 = 0; m0 < rows; m0 += MAX_ROWS) {
            const float* xm = x + m0 * ldx;
            float* om = out + m0 * ldo + p * PANEL;
            switch (rows - m0 < MAX_ROWS ? rows - m0 : MAX_ROWS) {
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
            }
        }
    }
}
"""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_LIBRARY = CLibrary("panel_linear", _SOURCE, {
    "pack_panels": ([_ptr, _i64, _i64, _ptr], None),
    "panel_linear": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64], None),
}, disable_env="GRAPHSERVE_CPU_LINEAR")

# Row counts this kernel takes (see the module docstring); others go to torch (MKL).
MIN_ROWS, MAX_ROWS = 1, 32


def available() -> bool:
    return _LIBRARY.get() is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] (float32, CPU) as panels [ceil(N / 16), K, 16], or None where the kernel
    does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    lib = _LIBRARY.get()
    if lib is None:
        return None
    weight = weight.detach().contiguous()
    n, k = weight.shape
    panels = torch.empty((-(-n // PANEL), k, PANEL), dtype=torch.float32)
    lib.pack_panels(weight.data_ptr(), n, k, panels.data_ptr())
    return panels


def applies(x: torch.Tensor, panels: torch.Tensor | None) -> bool:
    return (panels is not None and MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dim() == 2
            and x.dtype == torch.float32 and x.stride(-1) == 1)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) [M, n], W given as pack_panels(W); the caller checked applies()."""
    lib = _LIBRARY.get()
    rows, k = x.shape
    assert panels.shape[1] == k and (bias is None or bias.is_contiguous())
    out = torch.empty((rows, n), dtype=torch.float32)
    lib.panel_linear(x.data_ptr(), rows, x.stride(0), panels.data_ptr(), n, k,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), n)
    return out


if __name__ == "__main__":  # build it now (e.g. in a Docker image) and say whether it works
    logging.basicConfig(level=logging.INFO)
    print("CPU panel linear:", "built" if available() else "unavailable", file=sys.stderr)
