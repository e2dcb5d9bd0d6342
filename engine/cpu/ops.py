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

from graphserve.engine.cpu.build import CLibrary


_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
LIBRARY = CLibrary("cpu_ops", "ops.c", {
    "add_rms_norm": ([_ptr, _i64, _ptr, _i64, _ptr, _f32, _i64, _i64, _ptr, _i64, _ptr, _i64], None),
    "silu_mul": ([_ptr, _i64, _i64, _i64, _ptr, _i64], None),
}, disable_env="GRAPHSERVE_CPU_OPS")


def available() -> bool:
    return LIBRARY.get() is not None


def _applies(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(-1) == 1
               for t in tensors)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, library: CLibrary = LIBRARY) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rmsnorm(x + residual) * weight, x + residual) for x [T, H] (residual None: rmsnorm(x) and
    x itself), or None where the kernel does not apply."""
    if not _applies(x, *([residual] if residual is not None else [])) or weight.dtype != torch.float32 \
            or not weight.is_contiguous() or weight.shape != (x.shape[1],) \
            or (residual is not None and residual.shape != x.shape):
        return None
    lib = library.get()
    if lib is None:
        return None
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=torch.float32)
    new_residual = torch.empty((rows, hidden), dtype=torch.float32) if residual is not None else x
    lib.add_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                     0 if residual is None else residual.stride(0), weight.data_ptr(), eps, rows, hidden,
                     out.data_ptr(), hidden, None if residual is None else new_residual.data_ptr(), hidden)
    return out, new_residual


def silu_mul(y: torch.Tensor, library: CLibrary = LIBRARY) -> torch.Tensor | None:
    """silu(gate) * up for y = [gate, up] [T, 2I], or None where the kernel does not apply."""
    if not _applies(y) or y.shape[1] % 2:
        return None
    lib = library.get()
    if lib is None:
        return None
    rows, inter = y.shape[0], y.shape[1] // 2
    out = torch.empty((rows, inter), dtype=torch.float32)
    lib.silu_mul(y.data_ptr(), y.stride(0), rows, inter, out.data_ptr(), inter)
    return out


if __name__ == "__main__":  # build it now (e.g. in a Docker image) and say whether it works
    logging.basicConfig(level=logging.INFO)
    print("CPU fused ops:", LIBRARY.isa() or "unavailable", file=sys.stderr)
