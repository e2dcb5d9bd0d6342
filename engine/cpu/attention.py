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

from graphserve.engine.cpu.build import CLibrary


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
LIBRARY = CLibrary("paged_decode", "attention.c", {"paged_decode": (
    [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64, _i64,
     _ptr],
    None)}, disable_env="GRAPHSERVE_CPU_ATTENTION")


def available() -> bool:
    return LIBRARY.get() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, library: CLibrary = LIBRARY, window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """q [B, Hq, D] (last dim contiguous); caches [N, block_size, Hkv, D]; block_tables [B, W]
    int32; context_lens [B] int32 (each >= 1). window: a sliding window, row b attends to its last
    `window` tokens only (None: all). sinks [Hq] float32 (gpt-oss): each head's sink logit, a term of
    its softmax's denominator. Returns [B, Hq, D], or None (caller falls back)."""
    if (q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu"
            or q.stride(2) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32
            or block_tables.stride(1) != 1 or not context_lens.is_contiguous()
            or (sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()
                                       or sinks.shape != (q.shape[1],)))):
        return None
    lib = library.get()
    if lib is None:
        return None
    batch, num_heads, head_dim = q.shape
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype)
    lib.paged_decode(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                     block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(),
                     batch, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale,
                     int(batch < 2 * torch.get_num_threads()), window or 0,
                     None if sinks is None else sinks.data_ptr())
    return out


if __name__ == "__main__":  # build it now (e.g. in a Docker image) and say whether it works
    logging.basicConfig(level=logging.INFO)
    print("CPU decode attention:", LIBRARY.isa() or "unavailable", file=sys.stderr)
