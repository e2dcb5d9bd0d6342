"""RMSNorm and fused residual-add + RMSNorm with Hugging Face LlamaRMSNorm rounding.

HF: normalise in fp32, cast to the input dtype, then multiply by the weight. The kernels follow
the same rounding steps, so bf16 results match transformers, not just a higher-precision value.
Outputs are in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # the stored residual is rounded to the input dtype, and that rounded value is normalised
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, 0) / hidden
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, res_out: torch.Tensor | None) -> None:
    rows, hidden = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        hidden, eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"expected x [T, H] with contiguous rows and weight [H], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, H] (rows may be strided) with weight [H]; returns a new [T, H] tensor."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (fp32 add, stored in x's dtype); normed = rms_norm(new_residual).

    Returns (normed, new_residual), both new tensors; the inputs are not modified.
    """
    _check(x, weight)
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, new_residual)
    return out, new_residual


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
