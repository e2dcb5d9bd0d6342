"""Tests of kernels/step_bookkeeping.py, a decode step's bookkeeping in two kernels.

The two kernels (engine/runner/model_runner.py's
FUSED_STEP_BOOKKEEPING) against what it must do and against the torch ops it replaces (its refs,
the engine's path elsewhere), on the strided [K, B] views the CUDA graphs hand it (a batch bucket's
columns of buffers sized for the largest one). In Triton's interpreter here; on CUDA in
tests/test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch

from graphserve.kernels.step_bookkeeping import record_step, record_step_ref, step_inputs, step_inputs_ref


def bucket_views(k: int, batch: int, width: int, seed: int):
    """[K, batch] column slices of [K, width] buffers, as engine/runner/cuda_graphs.py makes them."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (k, width), generator=gen)
    slots = torch.randint(-1, 1 << 20, (k, width), generator=gen)
    context_lens = torch.randint(1, 4096, (k, width), generator=gen, dtype=torch.int32)
    return positions[:, :batch], slots[:, :batch], context_lens[:, :batch], gen


@pytest.mark.parametrize("batch", [1, 3, 300])
def test_step_inputs_read_the_steps_row(batch):
    positions, slots, context_lens, _ = bucket_views(4, batch, 512, seed=batch)
    for s in range(4):
        step = torch.tensor(s)
        pos, slot, ctx = step_inputs(step, positions, slots, context_lens)
        assert torch.equal(pos, positions[s]) and torch.equal(slot, slots[s]) and torch.equal(ctx, context_lens[s])
        assert ctx.dtype == torch.int32 and int(step) == s


@pytest.mark.parametrize("batch", [1, 5, 1100])  # 1100: more rows than one pass of the kernel's block
def test_record_step_writes_the_steps_row_and_advances(batch):
    k, width = 3, 1200
    gen = torch.Generator().manual_seed(batch)
    token_buffer = torch.zeros(k, width, dtype=torch.int64)
    out_tokens = token_buffer[:, :batch]
    out_logprobs = torch.zeros(k, width, dtype=torch.float32)[:, :batch]
    input_ids = torch.zeros(batch, dtype=torch.int64)
    output_pos = torch.randint(0, 100, (batch,), generator=gen)
    step = torch.tensor(0)
    expected_tokens, expected_logprobs, start_pos = out_tokens.clone(), out_logprobs.clone(), output_pos.clone()
    for s in range(k):
        tokens = torch.randint(0, 150000, (batch,), generator=gen)
        logprobs = -torch.rand(batch, generator=gen)
        record_step(step, tokens, logprobs, out_tokens, out_logprobs, input_ids, output_pos)
        expected_tokens[s], expected_logprobs[s] = tokens, logprobs
        assert int(step) == s + 1
        assert torch.equal(input_ids, tokens)
        assert torch.equal(output_pos, start_pos + s + 1)
    assert torch.equal(out_tokens, expected_tokens) and torch.equal(out_logprobs, expected_logprobs)
    assert token_buffer[:, batch:].eq(0).all()  # the other buckets' columns untouched


def test_kernels_and_torch_ops_leave_the_same_state():
    """Three steps of a round through the kernels and through the refs, from equal states."""
    positions, slots, context_lens, gen = bucket_views(3, 7, 16, seed=3)
    states = []
    for read, record in ((step_inputs, record_step), (step_inputs_ref, record_step_ref)):
        step, out_tokens, out_logprobs = torch.tensor(0), torch.zeros(3, 16, dtype=torch.int64)[:, :7], torch.zeros(3, 7)
        input_ids, output_pos = torch.zeros(7, dtype=torch.int64), torch.arange(7)
        inputs = []
        for s in range(3):
            inputs.append(read(step, positions, slots, context_lens))
            tokens = torch.arange(7) * 10 + s
            record(step, tokens, -tokens.float() / 100, out_tokens, out_logprobs, input_ids, output_pos)
        states.append((inputs, step, out_tokens, out_logprobs, input_ids, output_pos))
    (inputs_k, *state_k), (inputs_r, *state_r) = states
    assert all(torch.equal(a, b) for ka, ra in zip(inputs_k, inputs_r) for a, b in zip(ka, ra))
    assert all(torch.equal(a, b) for a, b in zip(state_k, state_r))


def test_rejects_rows_that_are_not_contiguous():
    positions, slots, context_lens, _ = bucket_views(2, 4, 8, seed=0)
    with pytest.raises(ValueError):
        step_inputs(torch.tensor(0), positions.t(), slots, context_lens)
    with pytest.raises(ValueError):
        record_step(torch.tensor(0), torch.zeros(4, 2, dtype=torch.int64)[:, 0], torch.zeros(4), torch.zeros(2, 4),
                    torch.zeros(2, 4), torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
