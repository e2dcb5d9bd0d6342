"""Gemma 3's text model against transformers: a tiny random Gemma3ForCausalLM (5 local layers with a
window of 8 and rope_local_base_freq, 1 global; q/k norms, (1 + w) RMSNorms, GeGLU, scaled embeddings,
pre/post feedforward norms, query_pre_attn_scalar, a final logit softcap), float32 on the CPU: greedy
tokens equal transformers', alone and batched, with prefix caching on and off, and the same weights as
a Gemma3ForConditionalGeneration checkpoint's text tower (language_model. prefix) give the same tokens.
Unsupported variants are refused naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import assert_greedy_matches, make_tiny_model, transformers_greedy

from graphserve import LLM, SamplingParams
from graphserve.engine.errors import UnsupportedModelError
from graphserve.engine.models.config import ModelArgs

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
PROMPTS = [[3 + (11 * i + 5 * j) % 400 for j in range(n)] for i, n in enumerate((6, 37, 1, 22, 45))]
PROMPTS += [PROMPTS[4][:40] + [7, 8, 9]]
MODELS = {"gemma3": {}, "gemma3_softcap": dict(final_logit_softcapping=3.0)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", "gemma3", seed=3, **MODELS[request.param])


@pytest.fixture(scope="module")
def hf_greedy(model_dir) -> list[list[int]]:
    return transformers_greedy(model_dir, PROMPTS, MAX_NEW)


def _llm(path: Path, **config) -> LLM:
    return LLM(str(path), device="cpu", num_kv_blocks=96, max_num_batched_tokens=32, decode_chunk=2, **config)


def test_the_config_is_read_as_transformers_reads_it(model_dir):
    args = ModelArgs.from_dir(model_dir)
    assert args.layer_windows == (8, 8, 8, 8, 8, None) and args.qk_norm
    assert args.gemma.query_pre_attn_scalar == 24 and args.gemma.local_rope_theta == 10_000.0


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_greedy_matches_transformers_alone_and_batched(model_dir, hf_greedy, prefix_caching):
    llm = _llm(model_dir, prefix_caching=prefix_caching)
    assert llm.engine.core.worker.model.cpu_stack is None  # q/k norms, Gemma's layer: the per-layer path
    assert_greedy_matches(llm, PROMPTS, GREEDY, hf_greedy, alone=4, distinct=2)


def test_the_torch_attention_fallback_matches_too(model_dir, hf_greedy):
    llm = _llm(model_dir)
    for layer in llm.engine.core.worker.model.layers:
        layer.self_attn.backend.use_kernel = False
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy


def test_a_multimodal_checkpoints_text_tower_serves_the_same(model_dir, hf_greedy, tmp_path):
    """Gemma3ForConditionalGeneration: text_config, the language model under language_model., a vision
    tower and projector beside it (not loaded)."""
    dest = tmp_path / "mm"
    shutil.copytree(model_dir, dest)
    text = json.loads((dest / "config.json").read_text())
    text.pop("architectures", None)
    (dest / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}, "eos_token_id": 2}))
    weights = load_file(str(dest / "model.safetensors"))
    renamed = {("language_model." + k if k.startswith(("model.", "lm_head.")) else k): v for k, v in weights.items()}
    renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(8, 3, 2, 2)
    renamed["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 64)
    (dest / "model.safetensors").unlink()
    save_file(renamed, str(dest / "model.safetensors"))
    assert [o.token_ids for o in _llm(dest).generate(PROMPTS, GREEDY)] == hf_greedy


BASE = dict(architectures=["Gemma3ForCausalLM"], vocab_size=16, hidden_size=64, intermediate_size=8,
            num_hidden_layers=6, num_attention_heads=4, head_dim=16)


@pytest.mark.parametrize("fields,named", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(layer_types=["chunked_attention"] * 6), "layer_types"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0},
                           "sliding_attention": {"rope_type": "default"}}), "rope_scaling"),
])
def test_unsupported_variants_are_refused_naming_the_field(fields, named):
    with pytest.raises(UnsupportedModelError, match=named):
        ModelArgs.from_hf_config({**BASE, **fields})


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_on_cuda_matches_transformers(model_dir, hf_greedy, enforce_eager):
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=32,
              num_kv_blocks=96, enforce_eager=enforce_eager)
    assert_greedy_matches(llm, PROMPTS, GREEDY, hf_greedy)
