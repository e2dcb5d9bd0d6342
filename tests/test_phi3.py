"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers: tiny random configs with full and partial rotary
(partial_rotary_factor), LongRoPE (short factors when the served context is within
original_max_position_embeddings, long ones when it is longer) and a sliding window, float32 on the CPU:
greedy tokens equal transformers', alone and batched, with prefix caching on and off; the rotary tables
equal transformers' Phi3RotaryEmbedding; unsupported variants are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import assert_greedy_matches, make_tiny_model, transformers_greedy

from graphserve import LLM, SamplingParams
from graphserve.engine.errors import UnsupportedModelError
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.models.loading.after_load import partial_rotary_order
from graphserve.kernels.rotary import build_cos_sin_cache

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
PROMPTS = [[3 + (11 * i + 5 * j) % 400 for j in range(n)] for i, n in enumerate((6, 37, 1, 22, 45))]
PROMPTS += [PROMPTS[4][:40] + [7, 8, 9]]


def _longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {"type": "longrope", "short_factor": [1.0 + i / 7 for i in range(half)],
            "long_factor": [3.0 + i for i in range(half)]}


# name -> (config fields, the context served, the prompts): where the context is longer than
# original_max_position_embeddings (LongRoPE's long factors), prompts longer than it, as transformers then
# rotates every position with the long factors
MODELS = {
    "phi3_plain": ({}, 512, PROMPTS),  # full rotary, no scaling (Phi-4's kind)
    # Phi-4-mini's kind (partial rotary, head_dim 16 here), served within the original length: short factors
    "phi3_longrope_partial": (dict(partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                   rope_scaling=_longrope(8)), 64, PROMPTS),
    # Phi-3-mini-128k's kind (su = LongRoPE), served past the original length: long factors; with a window
    # as the 4k model has one
    "phi3_su_window": (dict(original_max_position_embeddings=16, rope_scaling=dict(_longrope(16), type="su"),
                            sliding_window=11), 512, [p for p in PROMPTS if len(p) > 16]),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory) -> tuple[Path, int, list[list[int]]]:
    fields, context, prompts = MODELS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", "phi3", seed=5, **fields)
    return path, context, prompts


@pytest.fixture(scope="module")
def model_dir(model) -> Path:
    return model[0]


@pytest.fixture(scope="module")
def hf_greedy(model) -> list[list[int]]:
    return transformers_greedy(model[0], model[2], MAX_NEW)


def _llm(model, **config) -> LLM:
    path, context, _ = model
    return LLM(str(path), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, decode_chunk=2,
               max_model_len=context, **config)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_greedy_matches_transformers_alone_and_batched(model, hf_greedy, prefix_caching):
    prompts = model[2]
    llm = _llm(model, prefix_caching=prefix_caching)
    assert_greedy_matches(llm, prompts, GREEDY, hf_greedy, alone=1)


def test_the_per_layer_path_matches_transformers_too(model, hf_greedy):
    llm = _llm(model)
    layers = llm.engine.core.worker.model
    assert layers.cpu_stack is not None  # Phi-3 fits the decode stack
    layers.cpu_stack = None
    assert [o.token_ids for o in llm.generate(model[2], GREEDY)] == hf_greedy


@pytest.mark.parametrize("name", ["phi3_longrope_partial", "phi3_su_window"])
@pytest.mark.parametrize("context", [16, 64, 200])
def test_rotary_tables_equal_transformers(name, context, tmp_path):
    """Our table (in the permuted order, attention factor included) against transformers'
    Phi3RotaryEmbedding over a sequence as long as the served context: the short factors where it is
    within original_max_position_embeddings, the long ones where it is longer."""
    import transformers

    path = make_tiny_model(tmp_path / "m", "phi3", seed=5, **MODELS[name][0])
    config = transformers.AutoConfig.from_pretrained(path)
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    args = ModelArgs.from_dir(path)
    table = build_cos_sin_cache(args.head_dim, context, args.rope_theta, args.rope_scaling,
                                rotary_dim=args.rotary_dim)
    rd, half = args.rotary_dim or args.head_dim, args.head_dim // 2
    cos, sin = rotary(torch.zeros(1), torch.arange(context)[None])
    assert torch.equal(table[:, :rd // 2], cos[0, :, :rd // 2])
    assert torch.equal(table[:, half:half + rd // 2], sin[0, :, :rd // 2])
    assert torch.equal(table[:, rd // 2:half], torch.ones(context, half - rd // 2))
    assert rotary.attention_scaling != 1.0


def test_partial_rotary_order_pairs_the_rotary_dims():
    order = partial_rotary_order(16, 8).tolist()
    assert order[:4] == [0, 1, 2, 3] and order[8:12] == [4, 5, 6, 7]  # rotate_half pairs (i, i + 4) -> (i, i + 8)
    assert sorted(order) == list(range(16))


BASE = dict(architectures=["Phi3ForCausalLM"], vocab_size=16, hidden_size=64, intermediate_size=8,
            num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("fields,named", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(partial_rotary_factor=0.45), "partial_rotary_factor"),  # 7.2 -> 7 dims: odd
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling"),
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}), "short_factor"),
])
def test_unsupported_variants_are_refused_naming_the_field(fields, named):
    with pytest.raises(UnsupportedModelError, match=named):
        ModelArgs.from_hf_config({**BASE, **fields})


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_on_cuda_matches_transformers(model, hf_greedy, enforce_eager):
    llm = LLM(str(model[0]), device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=32,
              num_kv_blocks=64, max_model_len=model[1], enforce_eager=enforce_eager)
    assert_greedy_matches(llm, model[2], GREEDY, hf_greedy)
