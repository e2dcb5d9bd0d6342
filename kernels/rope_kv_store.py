"""Rotary embedding fused with the KV-cache write: one launch instead of two per layer.

q is rotated in place; k is rotated on the way into the cache (the k tensor itself is left
unchanged); v is copied. Same rounding as kernels.rotary, same slot rules as kernels.kv_store.
With Qwen3's per-head RMSNorm of q and k (qk_norm), the norms run here too, before the rotation,
rounded as kernels.rmsnorm rounds: three launches a layer fewer than norm, norm, rotate-and-store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.arg_checks import check_kv_cache
from graphserve.kernels.launch_settings import use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel
from graphserve.kernels.kv_store import store_kv_ref
from graphserve.kernels.rotary import _head_norm, _rotate_heads, apply_rotary_ref


@triton.jit
def _rope_kv_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_norm_ptr, k_norm_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, eps,
    NUM_Q_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
    HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if PDL:
        wait_for_previous_kernel()
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    dt = q_ptr.dtype.element_ty
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d).to(dt).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d).to(dt).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qh, t * stride_qt, cos, sin, q_norm_ptr, eps, NUM_Q_HEADS, Q_PAD, HALF, QK_NORM)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, KV_PAD)
    # slot broadcast to the tile first: a scalar-bool & tensor mask trips Triton's interpreter
    slots = tl.zeros([KV_PAD, HALF], dtype=tl.int64) + slot
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (slots >= 0)
    src_k = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * (NUM_KV_HEADS * 2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]

    x1 = tl.load(src_k, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_k + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = _head_norm(x1, x2, k_norm_ptr, offs_d, eps, HALF, dt)
    cache_dt = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, (x1 * cos - x2 * sin).to(dt).to(cache_dt), mask=mask)
    tl.store(k_cache_ptr + dst + HALF, (x2 * cos + x1 * sin).to(dt).to(cache_dt), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask).to(cache_dt), mask=mask)
    tl.store(v_cache_ptr + dst + HALF, tl.load(src_v + HALF, mask=mask).to(cache_dt), mask=mask)


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotate q [T, Hq, D] IN PLACE; write rotate(k) and v [T, Hkv, D] into the caches at
    slot_mapping [T] (slot -1 skipped). k is not modified. Returns q.
    qk_norm (q weight [D], k weight [D], eps): q and k RMS-normed per head first (Qwen3).

    Equivalent to apply_rotary(q, k, ...) followed by store_kv(k, v, ...), except for k itself.
    """
    _, _, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    num_tokens, num_q_heads, q_dim = q.shape
    if q_dim != head_dim or k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"q/k/v {tuple(q.shape)}/{tuple(k.shape)}/{tuple(v.shape)} do not match the cache")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError("q, k and v must share a dtype")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k, v and cos_sin_cache need a contiguous last dimension")
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} does not match head_dim {head_dim}")
    if qk_norm is not None and (qk_norm[0].shape != (head_dim,) or qk_norm[1].shape != (head_dim,)):
        raise ValueError(f"q/k norm weights {tuple(qk_norm[0].shape)}/{tuple(qk_norm[1].shape)}: not [{head_dim}]")
    if num_tokens == 0:
        return q
    pdl = use_pdl(q.device, elementwise=True)
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    _rope_kv_store_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_norm, k_norm,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, Q_PAD=triton.next_power_of_2(num_q_heads),
        NUM_KV_HEADS=num_kv_heads, KV_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        QK_NORM=qk_norm is not None,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return q


def rope_and_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Reference: the per-head norms (qk_norm), rotary (q copied back in place), then store_kv_ref
    of the rotated k."""
    from graphserve.kernels.rmsnorm import rms_norm_ref

    if qk_norm is not None:
        q_norm, k_norm, eps = qk_norm
        q.copy_(rms_norm_ref(q, q_norm, eps))
        k = rms_norm_ref(k, k_norm, eps)
    q_rot, k_rot = apply_rotary_ref(q, k, positions, cos_sin_cache)
    q.copy_(q_rot)
    store_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q
