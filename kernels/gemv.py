"""Matrix-vector products for decode-sized batches: out = x @ W.T for x [M, K] with few rows.

At batch 1 a decoder layer's projections are memory-bound matrix-vector products over a few MB
of weights each; cuBLAS picks split-K GEMM tiles for them (a GEMM plus a reduce kernel, ~40% of
bandwidth on an H200 for Qwen2.5-0.5B). Here one program computes BLOCK_N outputs of one row
over the whole K (W is row-major [N, K], so each output's weights are contiguous), and fuses
what sits around the projection in the decoder:

- prologue: RMSNorm of x (optionally of x + residual, writing the new residual): the norm kernel
  between projections disappears; every program recomputes the row's mean square (K values, from L2);
- epilogue: bias; SiLU-and-mul for a fused [gate; up] weight (each program reads the matching
  gate and up rows, so the [M, 2I] intermediate is never written); output dtype (float32 logits).

Rounding follows the unfused path step by step (residual, normalised value, weighted value and the
projection's output are each rounded to the model dtype), so fused and unfused agree to within the
summation order of the dot product. Launch parameters depend on shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import sm_count


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, bias_ptr, out_ptr,
    N, K, eps,
    stride_x, stride_r, stride_ro, stride_w, stride_o,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    x_row = x_ptr + m * stride_x
    r_row = res_ptr + m * stride_r
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    if SILU_MUL:
        up_rows = w_ptr + (offs_n + N).to(tl.int64)[:, None] * stride_w

    if HAS_NORM:
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            h = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h = (h + tl.load(r_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
            sq += h * h
        inv_rms = tl.rsqrt(tl.sum(sq, 0) / K + eps)

    # one program per row writes the new residual (the others only read the old one)
    res_store_end = tl.where(pid_n == 0, K, 0)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xk = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            if HAS_RESIDUAL:
                h = (xk + tl.load(r_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)).to(dt)
                tl.store(res_out_ptr + m * stride_ro + offs_k, h, mask=offs_k < res_store_end)
                xk = h.to(tl.float32)
            g = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            xk = ((xk * inv_rms).to(dt).to(tl.float32) * g).to(dt).to(tl.float32)
        wk_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=wk_mask, other=0.0)
        acc += w.to(tl.float32) * xk[None, :]
        if SILU_MUL:
            u = tl.load(up_rows + offs_k[None, :], mask=wk_mask, other=0.0)
            acc_up += u.to(tl.float32) * xk[None, :]

    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        gate = y.to(dt).to(tl.float32)
        up = tl.sum(acc_up, 1).to(dt).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
    tl.store(out_ptr + m * stride_o + offs_n, y.to(dt).to(out_ptr.dtype.element_ty), mask=n_mask)


class GemvTile(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


# Tile choice from benchmarks/gemv_bench.py --sweep on an H200 (one row; Qwen2.5-0.5B and
# Llama-3.1-8B projections; results in benchmarks/results/gemv_bench-*.json): K tiles of up to 1024
# (one or a few loop iterations, many loads in flight), enough programs to cover every SM 2x
# (4x for SiLU-and-mul, whose K tiles are 256 wide: gate and up are both in flight), and one
# output per program for a long K. 8 warps where the tile would need more than 64 registers a thread.
_MAX_BLOCK_K = 1024
_LONG_K = 4096


def default_gemv_tile(rows: int, n: int, k: int, num_sms: int, silu_mul: bool = False) -> GemvTile:
    block_k = min(_MAX_BLOCK_K if not silu_mul else 256, triton.next_power_of_2(k))
    if k > _LONG_K:
        return GemvTile(1, block_k, 8)
    target = (4 if silu_mul else 2) * num_sms
    block_n = 64
    while block_n > 1 and rows * triton.cdiv(n, block_n) < target:
        block_n //= 2
    while block_n * block_k * (2 if silu_mul else 1) > 8 * 32 * 64 and block_k > 64:
        block_k //= 2
    per_thread_4_warps = block_n * block_k * (2 if silu_mul else 1) / (4 * 32)
    return GemvTile(block_n, block_k, 8 if silu_mul or per_thread_4_warps > 64 else 4)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
    tile: GemvTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out = f(x) @ weight.T (+ bias), for x [M, K] (rows may be strided, last dim contiguous),
    weight [N, K] (contiguous rows).

    norm_weight: f(x) = rms_norm(x) * norm_weight, or rms_norm(x + residual) * norm_weight when
    residual [M, K] is given; the new residual (x + residual in x's dtype) is returned as a new tensor.
    silu_mul: weight is a fused [gate; up] of 2I rows and out = silu(x @ gate.T) * (x @ up.T), [M, I].
    out_dtype: the result, rounded to x's dtype, is stored in this dtype (default x's dtype).
    Returns (out, new_residual or None).
    """
    rows, k = x.shape
    if x.stride(-1) != 1 or weight.dim() != 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"expected x [M, K] and weight [N, K] with contiguous rows, got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("silu_mul needs an even number of weight rows and no bias")
    if residual is not None and (norm_weight is None or residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError("residual needs norm_weight and the shape of x")
    if norm_weight is not None and (norm_weight.shape != (k,) or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight must be [{k}] and contiguous")
    out = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    if rows == 0:
        return out, new_residual
    tile = tile or default_gemv_tile(rows, n, k, sm_count(x.device), silu_mul)
    _gemv_kernel[(rows, triton.cdiv(n, tile.block_n))](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        new_residual if new_residual is not None else out, weight, bias if bias is not None else weight, out,
        n, k, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        new_residual.stride(0) if new_residual is not None else 0, weight.stride(0), out.stride(0),
        HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
    )
    return out, new_residual


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused path in float32 arithmetic, rounded to x's dtype where the decoder rounds."""
    from kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref

    new_residual = None
    h = x
    if norm_weight is not None:
        if residual is not None:
            h, new_residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
        else:
            h = rms_norm_ref(x, norm_weight, eps)
    y = h.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if silu_mul:
        inter = y.shape[-1] // 2
        gate, up = y[..., :inter].float(), y[..., inter:].float()
        y = (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)
    return y.to(out_dtype or x.dtype), new_residual

