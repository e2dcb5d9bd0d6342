"""SwiGLU activation: silu(gate) * up on a fused [T, 2I] gate_up projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, inter,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        wait_for_previous_kernel()
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    dt = gate.dtype
    g = gate.to(tl.float32)
    # silu is rounded to x's dtype before the multiply, as eager torch does (act_fn(gate) * up)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up.to(tl.float32)).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (rows may be strided, last dim contiguous) -> silu(x[:, :I]) * x[:, I:], [T, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"expected x [T, 2I] with a contiguous last dim, got {tuple(x.shape)}")
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    pdl = use_pdl(x.device, elementwise=True)
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]
