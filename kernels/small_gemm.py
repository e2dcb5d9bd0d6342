"""Projections for 2-16 rows (small decode batches): out = f(x) @ W.T, each weight tile read once
for all rows.

kernels/gemv.py gives each row its own programs, so at 2-16 rows every row re-reads the weights;
cuBLAS reads them once but, for these shapes, reaches 9-40% of bandwidth on the small model's
projections, and has no weight-only FP8 path. Here one program computes BLOCK_N outputs of every
row: the rows (padded to 16) times the weight tile on the tensor cores (tl.dot), K tiles pipelined
through shared memory (num_stages). The same fusions as the one-row GEMV, minus rotary:

- prologue: RMSNorm of x, or of x + residual (the first column of programs writes the new residual);
- epilogue: bias; SiLU-and-mul for a fused [gate; up] weight (two products per program); FP8
  per-row weight scales; output dtype.

FP8 weights (int8 bytes here) become bf16 q * 2^-120 by two integer operations (sign to bit 15,
exponent and mantissa to bits 4-10: exact, bf16 has float32's exponent range); the inputs are
scaled by 2^64 and the sums by 2^56, as in kernels/gemv.py. Rounding follows the unfused decoder
(kernels.gemv.gemv_ref is the reference). Launch parameters depend on shapes only (CUDA-graph
capturable).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._common import dot_precision, use_pdl

MAX_ROWS = 16
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_X_PRESCALE = tl.constexpr(2.0**64)
_Y_RESCALE = tl.constexpr(2.0**56)


@triton.jit
def _weight_for_dot(w, FP8_BYTES: tl.constexpr, DOT_DT: tl.constexpr):
    """A weight tile in the dot's input dtype; FP8 bytes as q * 2^-120 (bf16 bits, or float32)."""
    if FP8_BYTES:
        if DOT_DT == tl.bfloat16:
            bits = ((w.to(tl.int32) << 4) & 0x87FF).to(tl.int16)  # the sign (bit 15) and bits 4-10
            return bits.to(tl.bfloat16, bitcast=True)
        bits = (w.to(tl.int32) << 20) & -2013265921  # 0x87FFFFFF
        return bits.to(tl.float32, bitcast=True).to(DOT_DT)
    return w.to(DOT_DT)


@triton.jit
def _small_gemm_kernel(
    x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, eps,
    stride_x, stride_r, stride_ro, stride_w, stride_o,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_W_SCALE: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PDL: tl.constexpr,
    DOT_DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    if SILU_MUL:
        u_rows = w_ptr + (offs_n + N).to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    r_rows = res_ptr + offs_m.to(tl.int64)[:, None] * stride_r
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

    inv_rms = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if HAS_NORM:
        sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mk = m_mask[:, None] & (offs_k < K)[None, :]
            h = tl.load(x_rows + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h = (h + tl.load(r_rows + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
            sq += h * h
        inv_rms = tl.rsqrt(tl.sum(sq, 1) / K + eps)

    res_store_end = tl.where(pid_n == 0, K, 0)  # the first column of programs writes the new residual
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mk = m_mask[:, None] & k_mask[None, :]
        xk = tl.load(x_rows + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
        if HAS_NORM:
            if HAS_RESIDUAL:
                h = (xk + tl.load(r_rows + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)).to(dt)
                tl.store(res_out_ptr + offs_m.to(tl.int64)[:, None] * stride_ro + offs_k[None, :], h,
                         mask=mk & (offs_k < res_store_end)[None, :])
                xk = h.to(tl.float32)
            g = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            xk = ((xk * inv_rms[:, None]).to(dt).to(tl.float32) * g[None, :]).to(dt).to(tl.float32)
        if HAS_W_SCALE:
            xk = xk * _X_PRESCALE
        xd = xk.to(DOT_DT)
        wk_mask = n_mask[:, None] & k_mask[None, :]
        w = _weight_for_dot(tl.load(w_rows + offs_k[None, :], mask=wk_mask, other=0), HAS_W_SCALE, DOT_DT)
        acc = tl.dot(xd, tl.trans(w), acc, input_precision=DOT_PREC)
        if SILU_MUL:
            u = _weight_for_dot(tl.load(u_rows + offs_k[None, :], mask=wk_mask, other=0), HAS_W_SCALE, DOT_DT)
            acc_u = tl.dot(xd, tl.trans(u), acc_u, input_precision=DOT_PREC)

    y = acc
    if HAS_W_SCALE:
        y *= (tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0) * _Y_RESCALE)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        up = acc_u
        if HAS_W_SCALE:
            up *= (tl.load(w_scale_ptr + N + offs_n, mask=n_mask, other=0.0) * _Y_RESCALE)[None, :]
        gate = y.to(dt).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(o_ptrs, y.to(dt).to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


class SmallGemmTile(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_small_gemm_tile(n: int, k: int, weight_bytes: int = 2) -> SmallGemmTile:
    """16 outputs a program (the tensor cores' smallest N), 512 bytes of each weight row per K tile."""
    return SmallGemmTile(16, min(512 // weight_bytes, triton.next_power_of_2(k)), 4, 3)


def small_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
    tile: SmallGemmTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kernels.gemv.gemv for x of up to MAX_ROWS rows: out = f(x) @ weight.T (+ bias), f the
    optional RMSNorm (of x + residual); silu_mul: weight is [gate; up]; weight_scale: FP8 weight
    row scales. Returns (out [M, N], new residual or None)."""
    from kernels.gemv import _check_inputs, _check_scale

    _check_inputs(x, weight, norm_weight, residual)
    _check_scale(weight, weight_scale)
    rows, k = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"small_gemm takes at most {MAX_ROWS} rows, got {rows}")
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("silu_mul needs an even number of weight rows and no bias")
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    if rows == 0:
        return out, new_residual
    fp8 = weight_scale is not None
    # the dot's inputs: the model's dtype (FP8 weights: bf16 bits, exact, for a bf16 model; else float32)
    dot_dtype = x.dtype if not fp8 or x.dtype == torch.bfloat16 else torch.float32
    tile = tile or default_small_gemm_tile(n, k, weight.element_size())
    pdl = use_pdl(x.device)
    _small_gemm_kernel[(triton.cdiv(n, tile.block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        new_residual if new_residual is not None else out, weight.view(torch.int8) if fp8 else weight,
        weight_scale if fp8 else out, bias if bias is not None else out, out,
        rows, n, k, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        new_residual.stride(0) if new_residual is not None else 0, weight.stride(0), out.stride(0),
        HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        HAS_W_SCALE=fp8,
        SILU_MUL=silu_mul,
        PDL=pdl,
        DOT_DT=_TL_DTYPES[dot_dtype],
        DOT_PREC=dot_precision(dot_dtype),
        BLOCK_M=MAX_ROWS,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        launch_pdl=pdl,
    )
    return out, new_residual


def small_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused decoder's math in float32 (kernels.gemv.gemv_ref: the same for any row count)."""
    from kernels.gemv import gemv_ref

    return gemv_ref(x, weight, bias, **kwargs)
