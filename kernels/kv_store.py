"""Write new tokens' keys and values into the paged KV cache, in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.arg_checks import check_kv_cache


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    # slot broadcast to the tile first: a scalar-bool & tensor mask trips Triton's interpreter
    slots = tl.zeros([HEADS_PAD, HEAD_DIM], dtype=tl.int64) + slot
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (slots >= 0)
    src_t = t.to(tl.int64)
    k = tl.load(k_ptr + src_t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + src_t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # a slot indexes one token of the contiguous cache: [num_blocks * block_size, Hkv, D]
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy k, v [T, Hkv, D] (strided views allowed, last dim contiguous) into the caches at
    slot_mapping [T] (int32/int64, slot = block * block_size + offset); slot -1 is skipped."""
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    num_tokens = k.shape[0]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not match the cache")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k/v last dimension must be contiguous")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        num_warps=4,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Pure-torch reference of store_kv (in place)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    keep = slots >= 0
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k[slots[keep]] = k[keep].to(k_cache.dtype)
    flat_v[slots[keep]] = v[keep].to(v_cache.dtype)
