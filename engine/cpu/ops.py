"""The CPU backend's elementwise fusions, float32: RMSNorm with the residual add before it, and
SiLU-and-mul, each one pass in a small C function (built by engine/cpu/build.py) where torch
runs several ops and temporaries (a 16-stream decode step of the embedded model spent ~5 ms in
them). Each returns None where it does not apply (no compiler, GRAPHSERVE_CPU_OPS=torch, not
float32 on CPU), and the caller runs torch. Results equal torch's to float32 rounding (the
sum of squares in another order; exp by a polynomial within 1e-8 relative)."""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

from graphserve.engine.cpu.build import AVX512_EXP16, CLibrary

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
""" + AVX512_EXP16 + r"""
#endif

/* res_out = x + residual (residual may be NULL: then res_out is NULL and h = x);
   out = h * (1 / sqrt(mean(h^2) + eps)) * weight, row by row; rows strided, last dim contiguous */
void add_rms_norm(const float* x, int64_t ldx, const float* residual, int64_t ldr, const float* weight,
                  float eps, int64_t rows, int64_t hidden, float* out, int64_t ldo, float* res_out, int64_t ldro) {
    #pragma omp parallel for schedule(static) if (rows * hidden >= 262144)
    for (int64_t m = 0; m < rows; ++m) {
        const float* xm = x + m * ldx;
        float* om = out + m * ldo;
        const float* h = xm;
        if (residual) {
            float* rm = res_out + m * ldro;
            const float* rr = residual + m * ldr;
            #pragma omp simd
            for (int64_t j = 0; j < hidden; ++j) rm[j] = xm[j] + rr[j];
            h = rm;
        }
        float sq = 0.f;
        #pragma omp simd reduction(+:sq)
        for (int64_t j = 0; j < hidden; ++j) sq += h[j] * h[j];
        const float inv = 1.f / sqrtf(sq / (float)hidden + eps);
        #pragma omp simd
        for (int64_t j = 0; j < hidden; ++j) om[j] = (h[j] * inv) * weight[j];
    }
}

/* out[m, j] = silu(y[m, j]) * y[m, inter + j], y rows strided [rows, 2 * inter] */
void silu_mul(const float* y, int64_t ldy, int64_t rows, int64_t inter, float* out, int64_t ldo) {
    #pragma omp parallel for schedule(static) if (rows * inter >= 262144)
    for (int64_t m = 0; m < rows; ++m) {
        const float* g = y + m * ldy;
        const float* u = g + inter;
        float* o = out + m * ldo;
        int64_t j = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.f);
        for (; j + 16 <= inter; j += 16) {
            const __m512 gv = _mm512_loadu_ps(g + j);
            const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_storeu_ps(o + j, _mm512_mul_ps(s, _mm512_loadu_ps(u + j)));
        }
#endif
        for (; j < inter; ++j) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
}
"""

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_LIBRARY = CLibrary("cpu_ops", _SOURCE, {
    "add_rms_norm": ([_ptr, _i64, _ptr, _i64, _ptr, _f32, _i64, _i64, _ptr, _i64, _ptr, _i64], None),
    "silu_mul": ([_ptr, _i64, _i64, _i64, _ptr, _i64], None),
}, disable_env="GRAPHSERVE_CPU_OPS")


def available() -> bool:
    return _LIBRARY.get() is not None


def _applies(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(-1) == 1
               for t in tensors)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rmsnorm(x + residual) * weight, x + residual) for x [T, H] (residual None: rmsnorm(x) and
    x itself), or None where the kernel does not apply."""
    if not _applies(x, *([residual] if residual is not None else [])) or weight.dtype != torch.float32 \
            or not weight.is_contiguous() or weight.shape != (x.shape[1],) \
            or (residual is not None and residual.shape != x.shape):
        return None
    lib = _LIBRARY.get()
    if lib is None:
        return None
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=torch.float32)
    new_residual = torch.empty((rows, hidden), dtype=torch.float32) if residual is not None else x
    lib.add_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                     0 if residual is None else residual.stride(0), weight.data_ptr(), eps, rows, hidden,
                     out.data_ptr(), hidden, None if residual is None else new_residual.data_ptr(), hidden)
    return out, new_residual


def silu_mul(y: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for y = [gate, up] [T, 2I], or None where the kernel does not apply."""
    if not _applies(y) or y.shape[1] % 2:
        return None
    lib = _LIBRARY.get()
    if lib is None:
        return None
    rows, inter = y.shape[0], y.shape[1] // 2
    out = torch.empty((rows, inter), dtype=torch.float32)
    lib.silu_mul(y.data_ptr(), y.stride(0), rows, inter, out.data_ptr(), inter)
    return out


if __name__ == "__main__":  # build it now (e.g. in a Docker image) and say whether it works
    logging.basicConfig(level=logging.INFO)
    print("CPU fused ops:", "built" if available() else "unavailable", file=sys.stderr)
