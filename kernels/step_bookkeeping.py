"""A decode round's per-step bookkeeping in one kernel each side of the model.

Each step of a round (engine/runner/model_runner.py) reads row `step` of the round's [K, B] positions, slots and
context lengths, and after sampling writes the tokens and their logprobs into row `step` of the
round's outputs, feeds the tokens back in and advances `step` and each row's output position. In
torch that is three index_selects before and two index_copies, a copy and two adds after: seven
small launches a step, none of which can overlap its neighbours. Here it is two, both launched with
programmatic dependent launch (kernels/launch_settings.PDL_ELEMENTWISE). step_inputs_ref and record_step_ref
are those torch ops, which the engine runs where the kernels do not apply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel

_BLOCK = 256  # rows a program covers at once (the record kernel's one program loops past it)


# Batch sizes and strides differ between the graphs' buckets and eager rounds (any batch): not
# specializing on them keeps one compiled variant per kernel, all compiled while the engine starts.
@triton.jit(do_not_specialize=["B", "stride_p", "stride_s", "stride_c"])
def _step_inputs_kernel(step_ptr, positions_ptr, slots_ptr, context_lens_ptr, pos_out_ptr, slot_out_ptr, ctx_out_ptr,
                        B, stride_p, stride_s, stride_c, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        wait_for_previous_kernel()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < B
    step = tl.load(step_ptr)
    tl.store(pos_out_ptr + offs, tl.load(positions_ptr + step * stride_p + offs, mask=mask), mask=mask)
    tl.store(slot_out_ptr + offs, tl.load(slots_ptr + step * stride_s + offs, mask=mask), mask=mask)
    tl.store(ctx_out_ptr + offs, tl.load(context_lens_ptr + step * stride_c + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["B", "stride_ot", "stride_ol"])
def _record_step_kernel(step_ptr, tokens_ptr, logprobs_ptr, out_tokens_ptr, out_logprobs_ptr, input_ids_ptr,
                        output_pos_ptr, B, stride_ot, stride_ol, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program: it alone advances the step, after every thread has read the old one."""
    if PDL:
        wait_for_previous_kernel()
    step = tl.load(step_ptr)
    for start in range(0, B, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < B
        tokens = tl.load(tokens_ptr + offs, mask=mask)
        tl.store(out_tokens_ptr + step * stride_ot + offs, tokens, mask=mask)
        tl.store(out_logprobs_ptr + step * stride_ol + offs, tl.load(logprobs_ptr + offs, mask=mask), mask=mask)
        tl.store(input_ids_ptr + offs, tokens, mask=mask)
        tl.store(output_pos_ptr + offs, tl.load(output_pos_ptr + offs, mask=mask) + 1, mask=mask)
    tl.debug_barrier()
    tl.store(step_ptr, step + 1)


def _check_rows(*tensors: torch.Tensor) -> None:
    if any(t.dim() != 2 or t.stride(1) != 1 or t.shape[1] != tensors[0].shape[1] for t in tensors):
        raise ValueError("expected [K, B] tensors of one batch, each row contiguous")


def step_inputs(step: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row `step` ([] int64 on the device) of the round's [K, B] positions, slots and context lengths
    (each row contiguous), as new [B] tensors."""
    _check_rows(positions, slots, context_lens)
    batch = positions.shape[1]
    pos, slot, ctx = torch.empty_like(positions[0]), torch.empty_like(slots[0]), torch.empty_like(context_lens[0])
    pdl = use_pdl(step.device, elementwise=True)
    _step_inputs_kernel[(triton.cdiv(batch, _BLOCK),)](
        step, positions, slots, context_lens, pos, slot, ctx, batch, positions.stride(0), slots.stride(0),
        context_lens.stride(0), BLOCK=_BLOCK, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return pos, slot, ctx


def record_step(step: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, out_tokens: torch.Tensor,
                out_logprobs: torch.Tensor, input_ids: torch.Tensor, output_pos: torch.Tensor) -> None:
    """out_tokens[step] = input_ids = tokens, out_logprobs[step] = logprobs, output_pos += 1, step += 1
    (tokens, logprobs, input_ids, output_pos: contiguous [B]; out_*: [K, B], each row contiguous;
    step: [] int64)."""
    _check_rows(out_tokens, out_logprobs, tokens[None], logprobs[None], input_ids[None], output_pos[None])
    batch = tokens.shape[0]
    pdl = use_pdl(step.device, elementwise=True)
    _record_step_kernel[(1,)](
        step, tokens, logprobs, out_tokens, out_logprobs, input_ids, output_pos, batch, out_tokens.stride(0),
        out_logprobs.stride(0), BLOCK=_BLOCK, PDL=pdl,
        num_warps=4, launch_pdl=pdl)


def step_inputs_ref(step: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """step_inputs in torch: three index_selects."""
    index = step[None]
    return (positions.index_select(0, index)[0], slots.index_select(0, index)[0],
            context_lens.index_select(0, index)[0])


def record_step_ref(step: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, out_tokens: torch.Tensor,
                    out_logprobs: torch.Tensor, input_ids: torch.Tensor, output_pos: torch.Tensor) -> None:
    """record_step in torch: two index_copies, a copy and two adds."""
    index = step[None]
    out_tokens.index_copy_(0, index, tokens[None])
    out_logprobs.index_copy_(0, index, logprobs[None])
    input_ids.copy_(tokens)
    output_pos += 1
    step += 1
