"""How the kernels launch on a device: its SM count, the programmatic dependent launch switches, dot precision."""

from __future__ import annotations

import functools

import torch

# H200 / H100 SXM; used when no CUDA device is present (interpreter mode on CPU).
DEFAULT_SM_COUNT = 132


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Number of streaming multiprocessors of `device` (a static property, safe during graph capture)."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
# kernel before it finishes; it reads what does not depend on that kernel (its weights), then waits
# (kernels/_pdl.py) before touching anything the kernel before wrote. Benchmarks set PDL = False to A/B.
PDL = True
# The kernels between the projections at 2 rows and more (RMSNorm, rotary + KV store, SiLU-and-mul,
# FP8 row quantization; at one row the GEMV fuses them) launch with PDL too when this is set: they
# wait for the kernel before them at their start. H200, 2026-12-02 (decode_latency.py --pdl-elementwise
# on|off): 0.5B batch 8 10,259 / 10,317 vs 8,918 / 8,920 tok/s, batch 64 58,947 / 59,301 vs 55,863 /
# 55,612; 8B FP8 batch 1 351.1 vs 341.7, batch 8 2,435 vs 2,340; 8B bf16 batch 64 12,034 vs 11,901.
PDL_ELEMENTWISE = True


def use_pdl(device: torch.device, elementwise: bool = False) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (sm90+, not the
    interpreter); elementwise: for the kernels PDL_ELEMENTWISE covers."""
    if not PDL or device.type != "cuda" or (elementwise and not PDL_ELEMENTWISE):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= 9


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: full fp32 for fp32 models (Triton defaults to tf32), else irrelevant."""
    return "ieee" if dtype == torch.float32 else "tf32"
