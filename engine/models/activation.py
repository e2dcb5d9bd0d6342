"""SiLU-and-mul of a fused [gate; up] row: the Triton kernel on CUDA, the C op on CPU, torch otherwise.
Its own module because both the dense layers and the FP8 projections use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphserve.engine.cpu import ops as cpu_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from graphserve.kernels.activation import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(x)
    fused = cpu_ops.silu_mul(x)
    if fused is not None:
        return fused
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
