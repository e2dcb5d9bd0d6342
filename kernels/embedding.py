"""The embedding lookup: rows of the embedding table gathered for a step's token ids.

torch's index_select is a kernel without programmatic dependent launch: the step's first layer
cannot start (and prefetch its weights) until it completes. This one launches with PDL like the
kernels around it (kernels/launch_settings.PDL_ELEMENTWISE). Ids outside the table are the caller's to
rule out (the engine checks prompts against the vocabulary); here they are clamped, never read
out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel


@triton.jit
def _embedding_kernel(ids_ptr, weight_ptr, out_ptr, vocab, hidden, stride_w, stride_o,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        wait_for_previous_kernel()
    token = tl.minimum(tl.maximum(tl.load(ids_ptr + row), 0), vocab - 1).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    tl.store(out_ptr + row * stride_o + offs, tl.load(weight_ptr + token * stride_w + offs, mask=mask), mask=mask)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids [T] (int32 / int64) -> weight[ids], [T, H] in weight's dtype (weight [V, H], rows contiguous)."""
    if ids.dim() != 1 or weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"expected ids [T] and a table [V, H] with contiguous rows, got {tuple(ids.shape)}, "
                         f"{tuple(weight.shape)}")
    vocab, hidden = weight.shape
    out = torch.empty((ids.shape[0], hidden), dtype=weight.dtype, device=weight.device)
    if ids.shape[0] == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    pdl = use_pdl(weight.device, elementwise=True)
    _embedding_kernel[(ids.shape[0], triton.cdiv(hidden, block))](
        ids, weight, out, vocab, hidden, weight.stride(0), out.stride(0), BLOCK=block, PDL=pdl, num_warps=4,
        launch_pdl=pdl)
    return out


def embedding_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.embedding(ids, weight)
