"""The CPU decode stack (engine/cpu/decoder.c, engine/models/cpu_stack.py): a decode step's layers
in one C call give the per-layer path's numbers bit for bit, on the float32 panels and on the
GGUF-quantized blocks, for one row and for batches, with a qkv bias (Qwen2), a GQA group and sliding
windows per layer; the
models it cannot take (q/k norms, mixtures of experts) keep the per-layer path."""

from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_model

from graphserve import LLM, SamplingParams
from graphserve.engine.cpu import decoder

pytestmark = pytest.mark.skipif(not decoder.available(), reason="no C compiler: the kernels are unavailable")

PROMPTS = [[5, 9, 14, 3, 77], [200, 201, 202], list(range(40, 80)), [17] * 20]


def decode_step_outputs(llm: LLM, batch: int, stack: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill `batch` prompts, then one decode step through the model: (hidden states, the K and V
    each layer wrote at the step's slots), with the stack on or off."""
    core = llm.engine.core
    model = core.worker.model
    kept = model.cpu_stack
    model.cpu_stack = kept if stack else None
    try:
        captured = {}
        forward = model.forward

        def spy(input_ids, positions, meta, kv_caches):
            out = forward(input_ids, positions, meta, kv_caches)
            if not meta.is_prefill:
                captured.setdefault("hidden", out.clone())
                captured.setdefault("kv", [torch.stack([c.flatten(0, 1)[meta.for_layer(i).slot_mapping] for c in pair])
                                           for i, pair in enumerate(kv_caches)])  # each layer's KV cache group's slots
            return out

        model.forward = spy
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        for i in range(batch):
            core.add_request(f"r{stack}-{batch}-{i}", PROMPTS[i % len(PROMPTS)] + [i + 3], params)
        while core.has_unfinished():
            core.step()
        return captured["hidden"], captured["kv"]
    finally:
        model.forward = forward
        model.cpu_stack = kept


# a windowed Mistral (each layer's window a field of the stack's layer; the prompts run past it) and a Qwen2
# whose upper layer slides (use_sliding_window, max_window_layers): the window per layer
STACK_MODELS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}),
                "mistral_window": ("mistral", dict(sliding_window=7)),
                "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=19, max_window_layers=1))}


@pytest.fixture(scope="module", params=sorted(STACK_MODELS))
def tiny_llm(request, tmp_path_factory) -> LLM:
    variant, overrides = STACK_MODELS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", variant, seed=3,
                           num_attention_heads=8, num_key_value_heads=2, hidden_size=128, **overrides)
    return LLM(str(path), device="cpu", num_kv_blocks=64, max_model_len=256, prefix_caching=False)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_the_stack_equals_the_per_layer_path_on_float32_panels(tiny_llm, batch):
    assert tiny_llm.engine.core.worker.model.cpu_stack is not None
    with_stack, k_with = decode_step_outputs(tiny_llm, batch, stack=True)
    without, k_without = decode_step_outputs(tiny_llm, batch, stack=False)
    assert with_stack.shape == (batch, 128)
    assert torch.equal(with_stack, without)
    assert all(torch.equal(a, b) for a, b in zip(k_with, k_without))


@pytest.fixture(scope="module")
def embedded_llm() -> LLM:
    return LLM(device="cpu", num_kv_blocks=64, max_model_len=256, prefix_caching=False)  # its Q4_1 blocks


@pytest.mark.parametrize("batch", [1, 5])
def test_the_stack_equals_the_per_layer_path_on_quantized_blocks(embedded_llm, batch):
    assert embedded_llm.engine.core.worker.quantization == "gguf" and embedded_llm.engine.core.worker.model.cpu_stack is not None
    with_stack, k_with = decode_step_outputs(embedded_llm, batch, stack=True)
    without, k_without = decode_step_outputs(embedded_llm, batch, stack=False)
    assert torch.equal(with_stack, without)
    assert all(torch.equal(a, b) for a, b in zip(k_with, k_without))


def test_greedy_tokens_do_not_change_with_the_stack(embedded_llm):
    model = embedded_llm.engine.core.worker.model
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "Once upon a time"]
    with_stack = embedded_llm.generate(prompts, params)
    kept, model.cpu_stack = model.cpu_stack, None
    try:
        without = embedded_llm.generate(prompts, params)
    finally:
        model.cpu_stack = kept
    for a, b in zip(with_stack, without):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize("variant", ["qwen3", "mixtral"])
def test_models_it_cannot_take_keep_the_per_layer_path(variant, tmp_path):
    path = make_tiny_model(tmp_path / "m", variant, seed=1)
    llm = LLM(str(path), device="cpu", num_kv_blocks=32, max_model_len=128)
    assert llm.engine.core.worker.model.cpu_stack is None
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))[0].token_ids) >= 1
