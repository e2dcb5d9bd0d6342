"""Mixture-of-experts models (Qwen3-MoE, Mixtral) on the CPU backend, float32: greedy tokens equal
transformers' own on the same tiny random weights (offline, batched, through the HTTP server); the
routed-experts layer against a plain per-token reference on its edge cases (an idle expert, one
expert taking every token, ties in the router, broken as transformers breaks them); and the
configs graphserve does not implement, refused at load with the field named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model, transformers_greedy

from graphserve import LLM, SamplingParams
from graphserve.engine.errors import InvalidConfigError, ModelFilesError, UnsupportedModelError
from graphserve.engine.models.attention import TorchAttention
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.models.hf_config.moe import MoeArgs
from graphserve.engine.models.loading.loader import load_model
from graphserve.engine.models.moe.sparse import SparseMoE, route
from graphserve.engine.models.sharding import check_tensor_parallel

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
PROMPTS = [[3 + (11 * i + 5 * j) % 400 for j in range(n)] for i, n in enumerate((6, 37, 1, 22, 45))]
MODELS = {  # name -> (tiny_models variant, config overrides)
    "mixtral": ("mixtral", {}),  # 8 experts, top-2, always renormalized
    "qwen3_moe_norm": ("qwen3_moe", {"norm_topk_prob": True}),  # 16 experts, top-4
    "qwen3_moe_no_norm": ("qwen3_moe", {"norm_topk_prob": False}),
}
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(model_name, tmp_path_factory) -> Path:
    variant, overrides = MODELS[model_name]
    return make_tiny_model(tmp_path_factory.mktemp(model_name) / "model", variant, seed=7, **overrides)


@pytest.fixture(scope="module")
def hf_greedy(model_dir) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, alone."""
    return transformers_greedy(model_dir, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    # a prefill budget under the longest prompt: prompts are chunked, and decodes ride along on CPU
    return LLM(str(model_dir), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, decode_chunk=2)


def test_single_prompt_greedy_matches_transformers(llm, hf_greedy):
    assert llm.generate([PROMPTS[1]], GREEDY)[0].token_ids == hf_greedy[1]


def test_batch_of_different_lengths_greedy_matches_transformers(llm, hf_greedy):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy
    assert len({tuple(o) for o in hf_greedy}) > 1  # the continuations differ: routing matters


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_on_cuda_matches_transformers(model_dir, hf_greedy, enforce_eager):
    """One GPU, float32, through kernels/moe.py's fused path: prefill (chunked: the budget is under
    the batch's tokens) and decode rounds, replayed from CUDA graphs or run eagerly, give transformers'
    greedy tokens on its own float32 (CPU) run."""
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
              num_kv_blocks=64, enforce_eager=enforce_eager)
    try:
        engine = llm.engine.core
        assert (engine.worker.graphs is None) == enforce_eager
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        alone = llm.generate([PROMPTS[1]], GREEDY)[0].token_ids
        replays = sum(engine.stats().graph_replays.values())
    finally:
        del llm
        torch.cuda.empty_cache()
    assert outs == hf_greedy
    assert alone == hf_greedy[1]
    assert (replays > 0) != enforce_eager, replays


@pytest.mark.gpu
def test_fp8_experts_on_cuda_decode_greedy_through_the_cuda_graphs(model_dir):
    """`--quantization fp8` on one GPU, bf16: the experts FP8 in kernels/moe.py's weight-only path
    (the attention projections W8A8, the router bf16). Greedy decode replays the graphs, the same
    batch again gives the same tokens; teacher-forced, the next token mostly agrees with the CPU
    float32 engine's on the same FP8 weights (bf16 and W8A8 activations apart). (Alone and batched
    may differ: one row's attention projections run the weight-only GEMV, several rows W8A8.)"""
    from graphserve.engine.models.fp8 import FP8

    logprobs = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    cpu = LLM(str(model_dir), device="cpu", num_kv_blocks=64, quantization="fp8", prefix_caching=False)
    want = [o.prompt_logprobs[1:] for o in cpu.generate(PROMPTS, logprobs)]
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", quantization="fp8", max_num_seqs=8,
              max_num_batched_tokens=64, num_kv_blocks=64, prefix_caching=False)
    try:
        mlp = llm.engine.core.worker.model.layers[0].mlp
        assert mlp.gate_up_proj.dtype == mlp.down_proj.dtype == FP8 and mlp.router.weight.dtype == torch.bfloat16
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        again = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        replays = sum(llm.engine.core.stats().graph_replays.values())
        got = [o.prompt_logprobs[1:] for o in llm.generate(PROMPTS, logprobs)]
    finally:
        del llm
        torch.cuda.empty_cache()
    assert all(len(o) == MAX_NEW for o in outs) and replays > 0
    assert again == outs
    pairs = [(w.top[0][0], g.top[0][0]) for ws, gs in zip(want, got) for w, g in zip(ws, gs)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.8, pairs


def test_http_completion_matches_transformers(model_dir, hf_greedy):
    httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
    from graphserve import AsyncEngine, EngineConfig
    from graphserve.server.app import create_app
    from live_server import BackgroundServer

    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64, decode_chunk=2)
    with BackgroundServer(create_app(AsyncEngine(config))) as server:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[3], "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == hf_greedy[3]


# ---- the routed-experts layer against a plain reference ----

HIDDEN, INTER = 32, 16


def make_layer(num_experts: int, top_k: int, renormalize: bool, seed: int = 0) -> SparseMoE:
    gen = torch.Generator().manual_seed(seed)
    layer = SparseMoE(HIDDEN, MoeArgs(num_experts, top_k, INTER, renormalize))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def reference_moe(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over the router logits, the top k, then each pick's SwiGLU expert
    times its (renormalized) probability."""
    probs = torch.softmax(F.linear(x, layer.router.weight), dim=-1)
    weights, picks = torch.topk(probs, layer.moe.top_k, dim=-1)
    if layer.moe.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], picks[t]):
            gate, up = (layer.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += weight * (layer.down_proj[e] @ (F.silu(gate) * up))
    return out


def transformers_router(layer: SparseMoE, arch: str):
    """transformers' own router module for this layer's shape, holding its router weight."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    moe = layer.moe
    if arch == "mixtral":
        router = MixtralTopKRouter(transformers.MixtralConfig(
            hidden_size=HIDDEN, num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k))
    else:
        router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN, num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
            norm_topk_prob=moe.renormalize))
    with torch.no_grad():
        router.weight.copy_(layer.router.weight)
    return router


def positive_inputs(tokens: int, seed: int = 1) -> torch.Tensor:
    """Inputs with every entry positive, so a router row of all +c (or -c) raises (or sinks) its
    expert for every token."""
    return torch.rand(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)) + 0.1


@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 3, 40])  # decode-sized and prefill-sized batches
@pytest.mark.parametrize("renormalize", [True, False])
def test_layer_matches_reference(tokens, renormalize):
    layer = make_layer(8, 2, renormalize)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_an_expert_that_gets_no_token():
    layer = make_layer(8, 2, renormalize=True)
    idle = 5
    layer.router.weight[idle] = -1.0
    x = positive_inputs(24)
    _, picks = route(layer.router(x), 2, True)
    assert not (picks == idle).any()
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("top_k", [1, 2])
def test_every_token_routed_to_one_expert(top_k):
    layer = make_layer(8, top_k, renormalize=False)
    busy = 3
    layer.router.weight[busy] = 1.0
    x = positive_inputs(24)
    _, picks = route(layer.router(x), top_k, False)
    assert (picks == busy).any(dim=1).all()
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)


@torch.no_grad()
@pytest.mark.parametrize("arch, renormalize", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
@pytest.mark.parametrize("tie", ["three experts tie for two places", "all experts tie"])
def test_router_ties_break_as_in_transformers(arch, renormalize, tie):
    layer = make_layer(8, 2, renormalize)
    if tie == "all experts tie":
        layer.router.weight.zero_()  # transformers' Qwen3-MoE router starts at zero
    else:
        layer.router.weight[[1, 4, 6]] = 0.5
    x = positive_inputs(12)
    weights, picks = route(layer.router(x), 2, renormalize)
    top3 = torch.softmax(layer.router(x), -1).topk(3).values
    assert torch.equal(top3[:, 0], top3[:, 2])  # every token: a tie across the top-2 boundary
    _, want_weights, want_picks = transformers_router(layer, arch)(x)
    assert torch.equal(picks, want_picks)
    assert torch.equal(weights, want_weights.float())
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)


# ---- configs refused at load ----

def hf_config(arch: str, **fields) -> dict:
    """A config.json's contents as transformers writes it, with `fields` set (or added) afterwards."""
    if arch == "mixtral":
        config = transformers.MixtralConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=8)
        config.architectures = ["MixtralForCausalLM"]
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, num_experts=16,
                                             num_experts_per_tok=4)
        config.architectures = ["Qwen3MoeForCausalLM"]
    return {**config.to_dict(), **fields}


def test_supported_configs_parse():
    qwen = ModelArgs.from_hf_config(hf_config("qwen3_moe", norm_topk_prob=True))
    assert qwen.moe == MoeArgs(num_experts=16, top_k=4, expert_intermediate_size=32, renormalize=True)
    assert qwen.qk_norm and not qwen.qkv_bias
    hub_style = hf_config("qwen3_moe", num_experts=128)  # the hub's Qwen3-MoE configs name it num_experts
    del hub_style["num_local_experts"]
    assert ModelArgs.from_hf_config(hub_style).moe.num_experts == 128
    mixtral = ModelArgs.from_hf_config(hf_config("mixtral"))
    assert mixtral.moe == MoeArgs(num_experts=8, top_k=2, expert_intermediate_size=32, renormalize=True)
    assert mixtral.layer_windows == (None, None) and not mixtral.qk_norm


def test_the_benchmark_shapes_of_qwen3_30b_a3b_and_mixtral_parse_as_served(monkeypatch, tmp_path):
    """benchmarks/random_models.py's real configs, as the GPU benchmarks load them (load_format
    dummy): the engine reads the experts, top-k and renormalization the models define, and nothing
    in them is refused on CUDA."""
    import sys

    monkeypatch.setenv("GRAPHSERVE_RANDOM_MODELS", str(tmp_path))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from random_models import random_model_config

    from graphserve.engine.models.hf_config.moe import check_moe_servable

    want = {"qwen3-30b-a3b": MoeArgs(num_experts=128, top_k=8, expert_intermediate_size=768, renormalize=True),
            "mixtral-8x7b": MoeArgs(num_experts=8, top_k=2, expert_intermediate_size=14336, renormalize=True)}
    for name, moe in want.items():
        args = ModelArgs.from_dir(random_model_config(name))
        assert args.moe == moe and set(args.layer_windows) == {None}
        check_moe_servable(args.architecture, args.moe, args.quantization, torch.device("cuda"), None)


@pytest.mark.parametrize("arch, field, value", [
    ("qwen3_moe", "decoder_sparse_step", 2),
    ("qwen3_moe", "mlp_only_layers", [0]),
    ("qwen3_moe", "shared_expert_intermediate_size", 128),  # Qwen2-MoE's shared expert
    ("qwen3_moe", "attention_bias", True),
    ("qwen3_moe", "hidden_act", "gelu"),
    ("mixtral", "hidden_act", "gelu"),
    ("mixtral", "n_shared_experts", 2),
    ("mixtral", "scoring_func", "sigmoid"),
    ("mixtral", "num_experts_per_tok", 9),
])
def test_unsupported_config_is_refused_naming_the_field(arch, field, value):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelArgs.from_hf_config(hf_config(arch, **{field: value}))


def edited_copy(model_dir: Path, dest: Path, **fields) -> Path:
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **fields}))
    return dest


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mixtral_refusals") / "model", "mixtral", seed=7)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen_refusals") / "model", "qwen3_moe", seed=7)


def test_a_sliding_window_is_served_as_transformers_reads_it(mixtral_dir, qwen_dir, tmp_path):
    """A window in every layer (Mixtral; Qwen3-MoE with use_sliding_window) greedy-matches transformers on
    prompts longer than it; Qwen3-MoE's window without use_sliding_window is ignored, as transformers does."""
    mixtral = edited_copy(mixtral_dir, tmp_path / "mixtral", sliding_window=9)
    qwen = edited_copy(qwen_dir, tmp_path / "qwen", use_sliding_window=True, sliding_window=11)
    for path, window in ((mixtral, 9), (qwen, 11)):
        model = load_model(path, torch.float32, CPU, TorchAttention(16), 512)
        assert [layer.self_attn.window for layer in model.layers] == [window, window]
        llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, decode_chunk=2)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == transformers_greedy(path, PROMPTS, MAX_NEW)
    ignored = edited_copy(qwen_dir, tmp_path / "qwen_off", use_sliding_window=False, sliding_window=100)
    model = load_model(ignored, torch.float32, CPU, TorchAttention(16), 512)
    assert [layer.self_attn.window for layer in model.layers] == [None, None]


def test_other_devices_are_refused_before_anything_is_loaded(mixtral_dir):
    """MoE runs on the CPU backend or one CUDA GPU; another device is refused before any weight is
    read (no such device needed: the refusal shows on a machine without one)."""
    with pytest.raises(UnsupportedModelError, match="CPU backend or one CUDA GPU"):
        load_model(mixtral_dir, torch.bfloat16, torch.device("mps"), TorchAttention(16), 512)


def test_gguf_quantization_and_tensor_parallelism_where_untested_are_refused(mixtral_dir):
    """FP8 experts are served (tests/test_moe_fp8.py), GGUF blocks are not; ranks shard experts on CPU
    (tests/test_tensor_parallel.py), not yet on GPUs; a rank count that does not divide each expert's
    intermediate size (32 here) is refused."""
    with pytest.raises(InvalidConfigError, match="quantization gguf is not supported for mixture-of-experts"):
        load_model(mixtral_dir, torch.float32, CPU, TorchAttention(16), 512, quantization="gguf")
    args = ModelArgs.from_dir(mixtral_dir)
    check_tensor_parallel(args, 2, CPU)
    with pytest.raises(InvalidConfigError, match="CPU ranks only"):
        check_tensor_parallel(args, 2, torch.device("cuda"))
    with pytest.raises(InvalidConfigError, match="expert intermediate size 32"):
        check_tensor_parallel(args, 64, CPU)


def test_a_checkpoint_missing_an_expert_is_refused(qwen_dir, tmp_path):
    broken = shutil.copytree(qwen_dir, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.9.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFilesError, match=r"layers\.1\.mlp\.gate_up_proj"):
        load_model(broken, torch.float32, CPU, TorchAttention(16), 512)
