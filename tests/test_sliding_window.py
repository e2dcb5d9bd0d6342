"""Sliding-window attention against transformers: tiny random windowed models (Mistral, window in every
layer; Qwen2 with use_sliding_window, full layers below max_window_layers and windowed above), float32 on
the CPU, prompts longer than the window: greedy tokens equal transformers', alone and batched, with
prefix caching on (a second pass hitting the cache) and off, on the C attention kernel, the decode stack
and torch's fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import assert_greedy_matches, make_tiny_model, transformers_greedy

from graphserve import LLM, SamplingParams
from graphserve.engine.errors import UnsupportedModelError
from graphserve.engine.models.config import ModelArgs

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
# longer than the windows below (a shared start, so a second pass hits the prefix cache)
PROMPTS = [[3 + (11 * i + 5 * j) % 400 for j in range(n)] for i, n in enumerate((6, 37, 1, 22, 45))]
PROMPTS += [PROMPTS[4][:40] + [7, 8, 9]]
MODELS = {
    "mistral_w12": ("mistral", dict(sliding_window=12)),
    "mistral_w5": ("mistral", dict(sliding_window=5, num_key_value_heads=1)),
    "qwen2_mixed": ("qwen2", dict(use_sliding_window=True, sliding_window=9, max_window_layers=1,
                                  num_hidden_layers=3)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory) -> Path:
    variant, overrides = MODELS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", variant, seed=3, **overrides)


@pytest.fixture(scope="module")
def hf_greedy(model_dir) -> list[list[int]]:
    return transformers_greedy(model_dir, PROMPTS, MAX_NEW)


def _llm(model_dir: Path, **config) -> LLM:
    # a prefill budget under the longest prompt: prompts are chunked, and decodes ride along
    return LLM(str(model_dir), device="cpu", num_kv_blocks=96, max_num_batched_tokens=32, decode_chunk=2,
               **config)


def test_the_windows_are_read_per_layer(model_dir):
    args = ModelArgs.from_dir(model_dir)
    if args.architecture == "MistralForCausalLM":
        assert len(set(args.layer_windows)) == 1 and args.layer_windows[0] in (5, 12)
    else:
        assert args.layer_windows == (None, 9, 9)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_greedy_matches_transformers_alone_and_batched(model_dir, hf_greedy, prefix_caching):
    llm = _llm(model_dir, prefix_caching=prefix_caching)
    assert_greedy_matches(llm, PROMPTS, GREEDY, hf_greedy, alone=4)


def test_torch_fallback_and_no_decode_stack_match_transformers(model_dir, hf_greedy):
    """The same tokens with the decode stack off (the per-layer path) and with the attention kernel off
    too (gather + SDPA with the window masked)."""
    llm = _llm(model_dir)
    model = llm.engine.core.worker.model
    assert model.cpu_stack is not None  # the windows are the stack's too
    model.cpu_stack = None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy
    for layer in model.layers:
        layer.self_attn.backend.use_kernel = False
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy


def test_a_window_changes_the_tokens(model_dir, hf_greedy, tmp_path):
    """The test means something: the same weights without the window continue differently."""
    import json
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    config = json.loads((plain / "config.json").read_text())
    config.update(sliding_window=None, use_sliding_window=False)
    config.pop("layer_types", None)
    (plain / "config.json").write_text(json.dumps(config))
    assert transformers_greedy(plain, PROMPTS, MAX_NEW) != hf_greedy


@pytest.mark.parametrize("field,value", [("sliding_window", 0), ("sliding_window", "4k")])
def test_a_bad_window_is_refused_naming_the_field(field, value):
    cfg = dict(architectures=["MistralForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=8,
               num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(UnsupportedModelError, match=field):
        ModelArgs.from_hf_config({**cfg, field: value})


def test_unknown_layer_types_are_refused_naming_the_field():
    cfg = dict(architectures=["Qwen2ForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=8,
               num_hidden_layers=2, num_attention_heads=2, use_sliding_window=True, sliding_window=4,
               layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        ModelArgs.from_hf_config(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_on_cuda_matches_transformers(model_dir, hf_greedy, enforce_eager):
    """One GPU, float32: the Triton prefill and decode kernels with the window as a constant, through
    the decode and prefill graphs or eagerly."""
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=32,
              num_kv_blocks=96, enforce_eager=enforce_eager)
    assert_greedy_matches(llm, PROMPTS, GREEDY, hf_greedy)
