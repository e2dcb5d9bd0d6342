"""The product LoRA adapters add to a projection on the CPU, float32: y[row] += (B @ (A @ x[row])) * scale
for each row with an adapter slot, in one C call (lora.c, built by engine/cpu/build.py) for all rows,
slices and slots, each row's sums in one fixed order (a row's numbers do not depend on its batch
mates). engine/lora/apply.py calls it for the per-layer path, decoder.c after each projection of the
decode stack, so both compute the same numbers.

`projection()` returns None where the kernel does not apply (no compiler, GRAPHSERVE_CPU_LORA=torch,
not float32 on the CPU, another layout), and the caller runs torch."""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

from graphserve.engine.cpu.build import CLibrary

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
MAX_SLICES = 4


class LoraProjection(ctypes.Structure):
    """lora.h's struct lora_projection: one projection's adapter slots (the tensors it points at are
    kept alive with it, in `tensors`)."""

    _fields_ = [("a", _ptr), ("b", _ptr), ("a_s0", _i64), ("b_s0", _i64), ("ranks", _ptr), ("scales", _ptr),
                ("slots", _i64), ("slices", _i64), ("rank_dim", _i64), ("in_features", _i64),
                ("slice_size", _i64 * MAX_SLICES)]


LIBRARY = CLibrary("lora", "lora.c", {"lora_add": ([_ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64], None)},
                   disable_env="GRAPHSERVE_CPU_LORA")


def available() -> bool:
    return LIBRARY.get() is not None


def projection(a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
               slice_sizes: tuple[int, ...], library: CLibrary = LIBRARY) -> LoraProjection | None:
    """The kernel's view of a projection's slots: a [S, slices, R, in] and b [S, out, R] (each slot's
    block contiguous, slots any stride apart: a layer's view of the stacked slots), ranks int32
    [S, slices] and scales float32 [S], read at each call (the runner rewrites them in place). None
    where the kernel does not take them."""
    if library.get() is None or len(slice_sizes) > MAX_SLICES or a.dim() != 4 or b.dim() != 3:
        return None
    slots, slices, rank_dim, in_features = a.shape
    if not (all(t.device.type == "cpu" for t in (a, b, ranks, scales)) and a.dtype == b.dtype == torch.float32
            and a.stride()[1:] == (rank_dim * in_features, in_features, 1) and b.stride()[1:] == (rank_dim, 1)
            and b.shape == (slots, sum(slice_sizes), rank_dim) and slices == len(slice_sizes)
            and ranks.dtype == torch.int32 and ranks.is_contiguous() and ranks.shape == (slots, slices)
            and scales.dtype == torch.float32 and scales.is_contiguous() and scales.shape == (slots,)):
        return None
    sizes = (_i64 * MAX_SLICES)(*slice_sizes)
    out = LoraProjection(a.data_ptr(), b.data_ptr(), a.stride(0), b.stride(0), ranks.data_ptr(), scales.data_ptr(),
                         slots, slices, rank_dim, in_features, sizes)
    out.tensors = (a, b, ranks, scales)
    return out


def lora_add(y: torch.Tensor, x: torch.Tensor, proj: LoraProjection, slots: torch.Tensor,
             library: CLibrary = LIBRARY) -> torch.Tensor:
    """y [T, out] (rows strided, the last dim contiguous) plus each row's adapter product, in place, for
    x [T, in] and slots int32 [T] (-1: no adapter); the caller took proj from projection()."""
    rows = x.shape[0]
    assert x.dtype == y.dtype == torch.float32 and x.stride(-1) == 1 and y.stride(-1) == 1
    assert x.shape[1] == proj.in_features and y.shape == (rows, sum(proj.slice_size[:proj.slices]))
    assert slots.dtype == torch.int32 and slots.is_contiguous() and slots.shape == (rows,)
    library.get().lora_add(ctypes.byref(proj), slots.data_ptr(), rows, x.data_ptr(), x.stride(0), y.data_ptr(),
                           y.stride(0))
    return y


if __name__ == "__main__":  # build it now (e.g. in a Docker image) and say whether it works
    logging.basicConfig(level=logging.INFO)
    print("CPU LoRA products:", LIBRARY.isa() or "unavailable", file=sys.stderr)
