"""RMSNorm and fused residual-add + RMSNorm with Hugging Face LlamaRMSNorm rounding.

HF: normalise in fp32, cast to the input dtype, then multiply by the weight. The kernels follow
the same rounding steps, so bf16 results match transformers, not just a higher-precision value.
Outputs are in x's dtype, or (rms_norm_fp8) quantized to float8 e4m3 with one scale per row, as
the W8A8 FP8 projection after the norm takes them: bit for bit kernels/fp8_quant.py applied to
the normed row in x's dtype, one kernel instead of two. With a residual, x may be the projection
before the norm still split over K (kernels/skinny_gemm.SplitPartials): the kernel sums it as the
skinny GEMM's reduce kernel would, bit for bit, and that reduce kernel is not launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel
from graphserve.kernels.fp8_quant import INV_FP8_MAX, FP8, quantize_row_values
from graphserve.kernels.skinny_gemm import SplitPartials, split_sum


# Warps a row's program takes at most (one per 256 values below that). 16, 8 and 4 measured alike for the
# 8B's 4096-wide rows at batch 64 (H200, interleaved, decode_latency.py --norm-max-warps: bf16 12,309 /
# 12,312, 12,281 / 12,274, 12,319 tok/s; FP8 16,326 / 16,236, 16,220 / 16,305, 16,079;
# 8615439:benchmarks/results/decode_latency-h200-norm-warps-ab-2026-12-02.json).
MAX_WARPS = 16


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    part_w_scale_ptr, part_x_scale_ptr, part_bias_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    rows, hidden, eps, inv_fp8_max,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT_FP8: tl.constexpr,
    SCALE_BY_RECIPROCAL: tl.constexpr,
    PDL: tl.constexpr,
    X_SPLIT: tl.constexpr,
    PART_W_SCALE: tl.constexpr,
    PART_X_SCALE: tl.constexpr,
    PART_BIAS: tl.constexpr,
):
    """QUANT_FP8: out_ptr is the e4m3 output viewed as uint8, the normed row is rounded to the
    residual's dtype (res_out_ptr's, which is x's) before it is quantized. X_SPLIT: x is a split-K
    product not summed yet (kernels/skinny_gemm.SplitPartials: x_ptr its [X_SPLIT, rows, hidden]
    float32 partials, the part_* its scales and bias), summed here as its reduce kernel would, and
    rounded to the residual's dtype."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # the weights: before the wait
    if PDL:
        wait_for_previous_kernel()
    if X_SPLIT:
        x = split_sum(x_ptr, part_x_scale_ptr, part_w_scale_ptr, part_bias_ptr, row, rows, hidden, offs, mask,
                      PART_BIAS, PART_W_SCALE, PART_X_SCALE, False, X_SPLIT)
        x = x.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # the stored residual is rounded to the input dtype, and that rounded value is normalised
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, 0) / hidden
    dtype = res_out_ptr.dtype.element_ty if QUANT_FP8 else out_ptr.dtype.element_ty
    normed = (x * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    y = (normed * w).to(dtype)
    if QUANT_FP8:
        values, scale = quantize_row_values(y.to(tl.float32), inv_fp8_max, SCALE_BY_RECIPROCAL)
        tl.store(out_ptr + row * stride_o + offs, values, mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def _launch(x: torch.Tensor | SplitPartials, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, res_out: torch.Tensor | None, scale: torch.Tensor | None = None) -> None:
    """scale given: out is float8 e4m3 (written as uint8), scale [rows, 1] float32."""
    rows, hidden = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    quant = scale is not None
    pdl = use_pdl(x.device, elementwise=True)
    split = x.partials.shape[0] if isinstance(x, SplitPartials) else 0
    if split:
        data, part_w_scale, part_x_scale, part_bias = x.partials, x.weight_scale, x.x_scale, x.bias
    else:
        data, part_w_scale, part_x_scale, part_bias = x, None, None, None
    _rms_norm_kernel[(rows,)](
        data, residual if residual is not None else data, weight, out.view(torch.uint8) if quant else out,
        res_out if res_out is not None else data, scale if quant else data,
        *(t if t is not None else data for t in (part_w_scale, part_x_scale, part_bias)),
        0 if split else data.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        rows, hidden, eps, INV_FP8_MAX,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        QUANT_FP8=quant,
        SCALE_BY_RECIPROCAL=out.is_cuda,
        PDL=pdl,
        X_SPLIT=split,
        PART_W_SCALE=part_w_scale is not None,
        PART_X_SCALE=part_x_scale is not None,
        PART_BIAS=part_bias is not None,
        num_warps=min(MAX_WARPS, max(1, block // 256)),
        launch_pdl=pdl,
    )


def _check(x: torch.Tensor | SplitPartials, weight: torch.Tensor, residual: torch.Tensor | None = None,
           needs_residual: bool = False) -> tuple[torch.dtype, torch.device]:
    """x's dtype and device, once its shape, weight's and residual's check out. A split product
    (SplitPartials) comes with a residual: it is rounded to the residual's dtype before it is added."""
    split = isinstance(x, SplitPartials)
    if len(x.shape) != 2 or (not split and x.stride(-1) != 1) or weight.shape != (x.shape[1],) \
            or not weight.is_contiguous():
        raise ValueError(f"expected x [T, H] with contiguous rows and weight [H], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is None and (needs_residual or split):
        raise ValueError("a residual is needed: a split-K product is normed only after a residual add")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1
                                 or (split and residual.dtype != x.dtype)):
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    return x.dtype, x.device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H] (rows may be strided) with weight [H]; returns a new [T, H] tensor."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor | SplitPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (fp32 add, stored in x's dtype); normed = rms_norm(new_residual).
    x may be a split-K product not summed yet (kernels/skinny_gemm.SplitPartials): summed here, bit
    for bit as its reduce kernel would.

    Returns (normed, new_residual), both new tensors; the inputs are not modified.
    """
    dtype, device = _check(x, weight, residual, needs_residual=True)
    out = torch.empty(x.shape, dtype=dtype, device=device)
    new_residual = torch.empty(x.shape, dtype=dtype, device=device)
    _launch(x, residual, weight, eps, out, new_residual)
    return out, new_residual


def rms_norm_fp8(x: torch.Tensor | SplitPartials, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [T, H] float8 e4m3, scale [T, 1] float32, x + residual or None): rms_norm(x + residual)
    in x's dtype, quantized per row as kernels/fp8_quant.quantize_rows_fp8 does, bit for bit. x may
    be a split-K product not summed yet, as fused_add_rms_norm takes it."""
    dtype, device = _check(x, weight, residual)
    if triton.next_power_of_2(x.shape[1]) > 16384:
        raise ValueError(f"rows of {x.shape[1]} are longer than the norm kernel holds")
    q = torch.empty(x.shape, dtype=FP8, device=device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=device)
    new_residual = torch.empty(x.shape, dtype=dtype, device=device) if residual is not None else None
    _launch(x, residual, weight, eps, q, new_residual, scale)
    return q, scale, new_residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm, with the result kept in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h.to(x.dtype).float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual
