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



_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
LIBRARY = CLibrary("panel_linear", "linear.c", {
    "pack_panels": ([_ptr, _i64, _i64, _ptr], None),
    "panel_linear": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64], None),
}, disable_env="GRAPHSERVE_CPU_LINEAR")

# Row counts this kernel takes (see the module docstring); others go to torch (MKL).
MIN_ROWS, MAX_ROWS = 1, 32


def available() -> bool:
    return LIBRARY.get() is not None


def pack_panels(weight: torch.Tensor, library: CLibrary = LIBRARY) -> torch.Tensor | None:
    """weight [N, K] (float32, CPU) as panels [ceil(N / 16), K, 16], or None where the kernel
    does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    lib = library.get()
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


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                 library: CLibrary = LIBRARY) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) [M, n], W given as pack_panels(W); the caller checked applies()."""
    lib = library.get()
    rows, k = x.shape
    assert panels.shape[1] == k and (bias is None or bias.is_contiguous())
    out = torch.empty((rows, n), dtype=torch.float32)
    lib.panel_linear(x.data_ptr(), rows, x.stride(0), panels.data_ptr(), n, k,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), n)
    return out


if __name__ == "__main__":  # build it now (e.g. in a Docker image) and say whether it works
    logging.basicConfig(level=logging.INFO)
    print("CPU panel linear:", LIBRARY.isa() or "unavailable", file=sys.stderr)
