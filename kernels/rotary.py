"""Rotary position embedding, Hugging Face "rotate_half" (NeoX) style, applied in place.

out = x * cos + rotate_half(x) * sin as in transformers' apply_rotary_pos_emb: cos/sin are rounded
to x's dtype first (as transformers does); the products and the sum are computed in fp32 and
rounded once, where eager transformers rounds after each op, so bf16/fp16 results can differ from
it by one unit in the last place (the GPU backend would fuse per-op roundings into an FMA anyway).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _head_norm(x1, x2, w_ptr, offs_d, eps, HALF: tl.constexpr, dt: tl.constexpr):
    """RMSNorm over each head (row) of [heads, 2 * HALF] given as its two halves, float32 in and
    out, rounded to dt where kernels.rmsnorm rounds (the normed value, then times the weight)."""
    inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
    y1 = ((x1 * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
    y2 = ((x2 * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    return y1, y2


@triton.jit
def _rotate_heads(x_ptr, stride_h, row_off, cos, sin, norm_ptr, eps,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """Rotate one token's heads in place; with NORM, RMS-norm each head first (weight norm_ptr)."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = offs_h[:, None] < NUM_HEADS
    ptr1 = x_ptr + row_off + offs_h[:, None] * stride_h + offs_d[None, :]
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if NORM:
        x1, x2 = _head_norm(x1, x2, norm_ptr, offs_d, eps, HALF, dt)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(dt), mask=mask)
    tl.store(ptr2, (x2 * cos + x1 * sin).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_Q_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
    NUM_K_HEADS: tl.constexpr, K_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d)
    dt = q_ptr.dtype.element_ty
    cos = cos.to(dt).to(tl.float32)[None, :]
    sin = sin.to(dt).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qh, t * stride_qt, cos, sin, q_ptr, 0.0, NUM_Q_HEADS, Q_PAD, HALF, False)
    _rotate_heads(k_ptr, stride_kh, t * stride_kt, cos, sin, k_ptr, 0.0, NUM_K_HEADS, K_PAD, HALF, False)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] IN PLACE at positions [T] (int32/int64).

    q and k may be strided views (e.g. of a fused qkv output) with a contiguous last dim.
    cos_sin_cache: [max_pos, D] float32, first D/2 columns cos, last D/2 sin (build_cos_sin_cache).
    Returns (q, k), the same tensors.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or q.dtype != k.dtype:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dimension")
    if cos_sin_cache.shape[1] != head_dim or head_dim & (head_dim - 1):
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} does not match head_dim {head_dim}")
    if num_tokens == 0:
        return q, k
    num_k_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, Q_PAD=triton.next_power_of_2(num_q_heads),
        NUM_K_HEADS=num_k_heads, K_PAD=triton.next_power_of_2(num_k_heads),
        HALF=head_dim // 2,
        num_warps=4,
    )
    return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb in the inputs' dtype; returns new tensors."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1).to(q.dtype)[:, None, :]
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1).to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32, CPU), computed as transformers computes them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    rope_type = None
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "longrope":  # Phi-3: short or long factors (use_long: build_cos_sin_cache decides)
        factors = rope_scaling["long_factor"] if rope_scaling.get("use_long") else rope_scaling["short_factor"]
        ext = torch.tensor(factors, dtype=torch.float32)
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (ext * base**shape)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, rope_scaling)
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are divided by factor, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}")


def _yarn_factor(rope_scaling: dict) -> float:
    factor = rope_scaling.get("factor")
    if factor is None:  # as transformers: the context's growth over the pretrained one
        factor = rope_scaling["max_position_embeddings"] / rope_scaling["original_max_position_embeddings"]
    return factor


def _yarn_inv_freq(head_dim: int, base: float, rope_scaling: dict) -> torch.Tensor:
    """YaRN's frequencies as transformers' _compute_yarn_parameters computes them: interpolated (divided
    by the factor) below the correction range, extrapolated (kept) above it, a linear ramp between;
    `truncate` (default true) rounds the range's ends outward to whole dims."""
    factor = _yarn_factor(rope_scaling)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1
    original = rope_scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(rope_scaling: dict | None) -> float:
    """The factor transformers multiplies cos and sin by (LongRoPE's and YaRN's attention_factor; 1
    otherwise)."""
    kind = rope_scaling.get("rope_type", rope_scaling.get("type")) if rope_scaling else None
    if kind == "yarn":
        if rope_scaling.get("attention_factor") is not None:
            return float(rope_scaling["attention_factor"])
        factor = _yarn_factor(rope_scaling)
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        return _yarn_mscale(factor)
    if kind != "longrope":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    original = rope_scaling["original_max_position_embeddings"]
    factor = rope_scaling.get("factor") or rope_scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def build_cos_sin_cache(
    head_dim: int,
    max_pos: int,
    base: float,
    rope_scaling: dict | None = None,
    device: torch.device | str | None = None,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """[max_pos, head_dim] float32: columns [:D/2] = cos(pos * inv_freq), [D/2:] = sin(...), times
    LongRoPE's attention factor where it has one.

    rotary_dim < head_dim (partial rotary, Phi-3's partial_rotary_factor): the frequencies of the first
    rotary_dim / 2 columns are the rotary dims', the rest are cos 1 and sin 0, which leave a dimension as
    it is; the loader orders each q and k head so that rotate_half over head_dim pairs the rotary dims as
    rotate_half over rotary_dim does (engine/models/phi3.py).
    Computed on the CPU in float32 (as transformers does, up to device libm) and moved to `device`.
    """
    rotary_dim = rotary_dim or head_dim
    if rope_scaling and rope_scaling.get("rope_type") == "longrope":
        # LongRoPE: transformers rotates a whole sequence with the long factors once it is longer than
        # original_max_position_embeddings (it recomputes the cache when a sequence crosses it), with the short
        # ones before. Here the served context decides for every sequence: the long factors where it is longer
        # (--max-model-len), the short ones where it is not, so that a sequence's positions never mix the two.
        rope_scaling = dict(rope_scaling, use_long=max_pos > rope_scaling["original_max_position_embeddings"])
    positions = torch.arange(max_pos, dtype=torch.int64).float()
    freqs = torch.outer(positions, rope_inv_freq(rotary_dim, base, rope_scaling))
    cos, sin = freqs.cos(), freqs.sin()
    factor = rope_attention_factor(rope_scaling)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    if rotary_dim < head_dim:
        rest = (head_dim - rotary_dim) // 2
        cos = torch.cat((cos, cos.new_ones(max_pos, rest)), dim=-1)
        sin = torch.cat((sin, sin.new_zeros(max_pos, rest)), dim=-1)
    return torch.cat((cos, sin), dim=-1).to(device=device)
