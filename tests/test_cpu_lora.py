"""The CPU LoRA kernel (engine/cpu/lora.c) against a float64 reference at shapes that are not the vectors'
multiples, mixed ranks (0 on a slice, below the slots' rank dim), rows without an adapter and strided
per-layer views of the stacked slots, in every build this machine executes (tests/cpu_builds.py); a
row's numbers are its own alone and in any batch; slot contents rewritten in place are read at the next
call. In the engine, a decode step whose rows mix the base model and adapters runs in the C decode stack
(engine/cpu/decoder.c) with the per-layer path's numbers, bit for bit; reading an adapter starts no OpenMP
threads."""

from __future__ import annotations

import os
import time

import pytest
import torch

from cpu_builds import builds, loaded
from tiny_models import make_tiny_model

from graphserve.engine.cpu import decoder
from graphserve.engine.cpu import lora as cpu_lora

pytestmark = pytest.mark.skipif(not cpu_lora.available(), reason="no C compiler: the kernels are unavailable")


def _slots(num_slots: int, slice_sizes: tuple[int, ...], k: int, rank_dim: int, seed: int, layers: int = 3):
    """A [S, slices, R, k] and B [S, out, R]: layer 1's views of stacked [S, layers, ...] slots, as the
    engine's projections hold them; ranks int32 [S, slices] and scales [S]."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, layers, len(slice_sizes), rank_dim, k, generator=gen) / k**0.5
    b = torch.randn(num_slots, layers, sum(slice_sizes), rank_dim, generator=gen) / rank_dim**0.5
    ranks = torch.randint(1, rank_dim + 1, (num_slots, len(slice_sizes)), generator=gen, dtype=torch.int32)
    ranks[0, 0] = 0  # slot 0 leaves its first slice alone
    ranks[-1, -1] = rank_dim
    scales = torch.rand(num_slots, generator=gen) * 4
    return a[:, 1], b[:, 1], ranks, scales


def _reference(y, x, a, b, ranks, scales, slice_sizes, slots) -> torch.Tensor:
    """y + each row's (B @ (A @ x)) * scale in float64."""
    out = y.double().clone()
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        start = 0
        for j, size in enumerate(slice_sizes):
            r = int(ranks[slot, j])
            u = a[slot, j, :r].double() @ x[row].double()
            out[row, start:start + size] += (b[slot, start:start + size, :r].double() @ u) * float(scales[slot])
            start += size
    return out


CASES = {"qkv": ((48, 16, 16), 72, 16), "one": ((130,), 200, 32), "gate_up": ((40, 40), 37, 16),
         "wide": ((576, 192, 192), 576, 16)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("library", builds(cpu_lora.LIBRARY))
def test_the_kernel_matches_a_float64_reference_and_each_row_is_its_own(case, library):
    library = loaded(library)
    slice_sizes, k, rank_dim = CASES[case]
    a, b, ranks, scales = _slots(4, slice_sizes, k, rank_dim, seed=len(case))
    proj = cpu_lora.projection(a, b, ranks, scales, slice_sizes, library)
    assert proj is not None
    gen = torch.Generator().manual_seed(7)
    rows, out = 11, sum(slice_sizes)
    x = torch.randn(rows, k + 3, generator=gen)[:, 2:2 + k]  # strided rows, not vector-aligned
    y = torch.randn(rows, out, generator=gen)
    slots = torch.tensor([2, -1, 0, 3, 1, 2, -1, 3, 0, 1, 2], dtype=torch.int32)
    got = cpu_lora.lora_add(y.clone(), x, proj, slots, library)
    torch.testing.assert_close(got.double(), _reference(y, x, a, b, ranks, scales, slice_sizes, slots),
                               rtol=2e-6, atol=2e-6)
    for row in (1, 6):  # no adapter: untouched
        assert torch.equal(got[row], y[row])
    assert torch.equal(got[2, :slice_sizes[0]], y[2, :slice_sizes[0]])  # slot 0 leaves its first slice alone
    assert not torch.equal(got[0], y[0])
    for row in range(rows):  # alone (its own aligned copy) as in the batch
        alone = cpu_lora.lora_add(y[row:row + 1].clone(), x[row:row + 1].clone(), proj, slots[row:row + 1], library)
        assert torch.equal(alone[0], got[row]), row
    order = torch.randperm(rows, generator=gen)  # and in another batch, at another place
    shuffled = cpu_lora.lora_add(y[order].clone(), x[order].contiguous(), proj, slots[order].contiguous(), library)
    assert torch.equal(shuffled, got[order])


@pytest.mark.parametrize("library", builds(cpu_lora.LIBRARY)[-2:])
def test_slot_contents_rewritten_in_place_are_read_at_the_next_call(library):
    library = loaded(library)
    slice_sizes, k = (24, 8, 8), 40
    a, b, ranks, scales = _slots(2, slice_sizes, k, 16, seed=3)
    proj = cpu_lora.projection(a, b, ranks, scales, slice_sizes, library)
    x, y = torch.randn(3, k), torch.randn(3, 40)
    slots = torch.tensor([1, 0, 1], dtype=torch.int32)
    cpu_lora.lora_add(y.clone(), x, proj, slots, library)
    new_a, new_b, new_ranks, _ = _slots(2, slice_sizes, k, 16, seed=4)
    a.copy_(new_a), b.copy_(new_b), ranks.copy_(new_ranks), scales.fill_(0.75)  # as engine/runner/lora_slots.py writes
    got = cpu_lora.lora_add(y.clone(), x, proj, slots, library)
    torch.testing.assert_close(got.double(), _reference(y, x, a, b, ranks, scales, slice_sizes, slots),
                               rtol=2e-6, atol=2e-6)


def test_it_refuses_what_it_cannot_take():
    a, b, ranks, scales = _slots(2, (8, 8), 16, 16, seed=5)
    assert cpu_lora.projection(a.double(), b.double(), ranks, scales, (8, 8)) is None
    assert cpu_lora.projection(a.bfloat16(), b.bfloat16(), ranks, scales, (8, 8)) is None
    assert cpu_lora.projection(a, b, ranks.long(), scales, (8, 8)) is None
    assert cpu_lora.projection(a, b, ranks, scales, (12, 4)) is not None  # any split of the output
    assert cpu_lora.projection(a, b, ranks, scales, (16,)) is None  # two slices of A, one of the output
    assert cpu_lora.projection(a.transpose(2, 3), b, ranks, scales, (8, 8)) is None


# ---- in the engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_llm(tmp_path_factory):
    pytest.importorskip("peft", reason="peft (a dev extra) makes the adapters")
    from lora_adapters import ADAPTER_SPECS, make_adapter

    from graphserve import LLM, LoraRequest

    root = tmp_path_factory.mktemp("cpu_lora")
    model = make_tiny_model(root / "llama", "llama", seed=3, num_attention_heads=8, num_key_value_heads=2,
                            hidden_size=128)
    loras = [LoraRequest(name, i + 1, str(make_adapter(model, root / name, seed=i, **ADAPTER_SPECS[name])))
             for i, name in enumerate(("attn", "all", "mlp"))]
    llm = LLM(str(model), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64,
              max_model_len=256, prefix_caching=False, warm_up=False)
    return llm, loras


def _decode_step(llm, loras: list, stack: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[bool]]:
    """The same prompt for each row (loras[i]: row i's adapter, None: the base model), one decode step:
    (the first decode step with adapter rows: its hidden states, the K and V each layer wrote; whether
    each decode step with adapter rows ran in the stack with them), the stack on or off."""
    from graphserve import SamplingParams

    model = llm.engine.core.worker.model
    kept, forward = model.cpu_stack, model.forward
    model.cpu_stack = kept if stack else None
    captured, stacked, ran = {}, [], []
    run = kept.run

    def spy_run(*args, **kwargs):  # the real run, noting whether the step's adapter rows came with it
        ran.append(kwargs.get("lora_slots") is not None)
        return run(*args, **kwargs)

    def spy(input_ids, positions, meta, kv_caches):
        ran.clear()
        out = forward(input_ids, positions, meta, kv_caches)
        if meta.is_prefill or meta.lora is None or not meta.lora.applies:
            return out
        stacked.append(ran == [True])
        if "hidden" not in captured:  # the first decode step with adapter rows
            captured["hidden"] = out.clone()
            captured["kv"] = [torch.stack([c.flatten(0, 1)[meta.for_layer(i).slot_mapping] for c in pair])
                              for i, pair in enumerate(kv_caches)]
        return out

    prompts = [[5, 9, 14, 3, 77, 21]] * len(loras)
    llm.generate(prompts, SamplingParams(max_tokens=1), lora_request=loras)  # the adapters in slots: rows start together
    kept.run, model.forward = spy_run, spy
    try:
        llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), lora_request=loras)
    finally:
        del kept.run
        model.forward, model.cpu_stack = forward, kept
    return captured["hidden"], captured["kv"], stacked


@pytest.mark.skipif(not decoder.available(), reason="no C compiler: the decode stack is unavailable")
def test_a_decode_step_mixing_base_and_adapter_rows_runs_in_the_stack_with_the_per_layer_numbers(lora_llm):
    llm, (attn, all_modules, mlp) = lora_llm
    assert llm.engine.core.worker.model.cpu_stack is not None
    for rows in ([None, attn, all_modules], [mlp, None, all_modules]):  # mlp: a slot rewritten in place
        with_stack, kv_with, stacked = _decode_step(llm, rows, stack=True)
        without, kv_without, not_stacked = _decode_step(llm, rows, stack=False)
        assert stacked and all(stacked) and not any(not_stacked)  # each step with adapter rows took the stack
        assert torch.equal(with_stack, without)
        assert all(torch.equal(a, b) for a, b in zip(kv_with, kv_without))
        base = rows.index(None)
        assert all(not torch.equal(with_stack[i], with_stack[base]) for i in range(3) if i != base)
    assert mlp.lora_id in llm.engine.core.worker.loras.held()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc (Linux)")
def test_loading_an_adapter_starts_no_openmp_threads(lora_llm, tmp_path):
    """The host cache reads an adapter on a thread whose torch ops run in it alone: a team of OpenMP threads
    of its own would leave the process more OpenMP threads than cores, and libgomp then puts every kernel's
    threads to sleep between parallel loops (each step's kernels waiting on their wake-ups)."""
    from lora_adapters import make_adapter

    from graphserve import LoraRequest
    from graphserve.engine.lora.host_cache import AdapterCache
    from graphserve.engine.models.config import ModelArgs
    from graphserve.engine.models.lora_layout import lora_layout

    llm, _ = lora_llm
    model = llm.engine.model_path
    # rank 64: A is [layers, 3, 64, 128], an op torch splits between threads
    wide = make_adapter(model, tmp_path / "wide", seed=9, r=64, lora_alpha=64, target_modules=["q_proj", "v_proj"])
    cache = AdapterCache(lora_layout(ModelArgs.from_dir(model)), 64, torch.float32, capacity=1, pin_memory=False)
    kept = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.zeros(1 << 20).fill_(1.0)  # this thread's team, started
        before = len(os.listdir("/proc/self/task"))
        lora = LoraRequest("wide", 50, str(wide))
        while not cache.ready(lora, set()):
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/task")) == before + 1  # the loading thread alone
    finally:
        torch.set_num_threads(kept)
        cache.close()
