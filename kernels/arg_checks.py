"""Shape checks of the kernel wrappers' arguments: paged KV layout, attention output, fused rotary + KV store."""

from __future__ import annotations

import torch


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
