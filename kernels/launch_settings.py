"""How the kernels launch on a device (SM count, programmatic dependent launch, dot precision), and argument checks."""

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


def attention_output(q: torch.Tensor, num_kv_heads: int, head_dim: int, out: torch.Tensor | None) -> torch.Tensor:
    """Check q [T, Hq, D] against the cache's heads and return the output tensor for it: `out`
    (checked) or a new one."""
    num_heads, q_dim = q.shape[1], q.shape[2]
    if q_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not match cache heads={num_kv_heads} dim={head_dim}")
    if q.stride(-1) != 1:
        raise ValueError("q's last dimension must be contiguous")
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)} with a contiguous last dim")
    return out


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate the paged cache layout and return (num_blocks, block_size, num_kv_heads, head_dim)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v cache must both be [num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k/v cache must be contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k/v cache dtypes differ")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size & (block_size - 1) or head_dim & (head_dim - 1):
        raise ValueError(f"block_size and head_dim must be powers of two, got {block_size}, {head_dim}")
    return num_blocks, block_size, num_kv_heads, head_dim


def rope_store_shapes(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      num_heads: int) -> tuple[int, int, int]:
    """Check the inputs of a projection with rotary and the KV-cache write fused in (a fused [q; k; v]
    weight, one position and slot per row of x) and return (q_size, kv_size, head_dim)."""
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if weight.shape[0] != q_size + 2 * kv_size or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"weight {tuple(weight.shape)} / cos_sin_cache {tuple(cos_sin_cache.shape)} do not match "
                         f"{num_heads} q heads and the cache's {num_kv_heads} kv heads of {head_dim}")
    if cos_sin_cache.stride(-1) != 1 or positions.shape != slot_mapping.shape or positions.shape[0] != x.shape[0]:
        raise ValueError("positions and slot_mapping need one entry per row; cos_sin_cache a contiguous last dim")
    return q_size, kv_size, head_dim
