"""LoRA adapters in the engine (engine/lora/, float32 on CPU): a tiny random Llama with three random peft
adapters of different ranks and modules gives transformers + peft's greedy tokens for each, also in one
batch with the base model and each other, through chunked prefills, preemption, the prefix cache, the
graph decoder's static buffers and n-gram speculation; an adapter seen later leaves the base model's
tokens alone; adapters a model cannot serve are refused, naming the cause."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("peft", reason="peft (a dev extra) makes the adapters and the reference")

from graphserve import LLM, LoraRequest, SamplingParams
from graphserve.engine.config import EngineConfig
from graphserve.engine.errors import AdapterError
from graphserve.engine.lora.adapter import inspect_adapter, load_adapter
from graphserve.engine.lora.layout import dense_layout
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.models.lora_layout import lora_layout
from graphserve.engine.runner.cuda_graphs import GraphDecoder
from graphserve.engine.tokenizer import Tokenizer
from lora_adapters import ADAPTER_SPECS, make_adapter, peft_greedy
from tiny_models import make_tiny_model

MAX_TOKENS = 12
# 41 tokens (the byte tokenizer: one per byte): two full KV blocks the prefix cache keys, and a chunked prefill
PROMPT = "The quick brown fox jumps over a lazy dog."
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(root / "llama", "llama")
    adapters = {name: make_adapter(model, root / name, seed=i, **spec)
                for i, (name, spec) in enumerate(ADAPTER_SPECS.items())}
    loras = {name: LoraRequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    return model, loras


@pytest.fixture(scope="module")
def expected(tiny):
    """transformers + peft's greedy tokens, by adapter name (None: the base model)."""
    model, loras = tiny
    ids = Tokenizer(model).encode(PROMPT)
    return ids, {name: peft_greedy(model, loras[name].path if name else None, ids, MAX_TOKENS)
                 for name in (None, *loras)}


@pytest.fixture(scope="module")
def llm(tiny):
    """Chunked prefills (8 tokens a step), a pool small enough that four requests preempt, 3 slots."""
    model, _ = tiny
    return LLM(str(model), device="cpu", enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=12,
               max_num_batched_tokens=8, decode_chunk=4, warm_up=False)


def test_each_adapter_gives_peft_tokens_alone_and_in_one_batch_with_the_others(tiny, expected, llm):
    _, loras = tiny
    ids, want = expected
    assert len({tuple(t) for t in want.values()}) == 4  # each adapter changes the output
    for name in (None, *loras):  # the same prompt each time: no adapter's cached KV serves another
        out = llm.generate([ids], GREEDY, lora_request=loras.get(name))[0]
        assert out.token_ids == want[name], name
    preempted = llm.engine.scheduler.num_preemptions
    mixed = llm.generate([ids] * 4, GREEDY, lora_request=[None, *loras.values()])
    assert [o.token_ids for o in mixed] == [want[n] for n in (None, *loras)]
    assert llm.engine.scheduler.num_preemptions > preempted  # 4 x 53 tokens in 11 blocks of 16
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_usable_blocks


def test_a_fourth_adapter_takes_the_least_recently_used_slot_and_the_base_model_is_unchanged(tiny, expected, llm):
    model, loras = tiny
    ids, want = expected
    other = LoraRequest("late", 99, loras["all"].path)  # another load: a new id, its own slot and cache keys
    assert llm.generate([ids], GREEDY, lora_request=other)[0].token_ids == want["all"]
    assert 99 in llm.engine.core.worker.loras.held()
    assert llm.generate([ids], GREEDY)[0].token_ids == want[None]
    assert llm.generate([ids], GREEDY, lora_request=loras["attn"])[0].token_ids == want["attn"]


def test_graph_decoder_static_rows_carry_each_rows_slot(tiny, expected, llm):
    """The CUDA graphs' static-buffer path, run eagerly on CPU: padded rows (-1) and every row's slot."""
    _, loras = tiny
    ids, want = expected
    core = llm.engine.core
    for name in ("mlp", "attn"):  # resident before the batch (loads run on a thread): the rows start together
        llm.generate([ids], GREEDY, lora_request=loras[name])
    graphs = GraphDecoder(core.worker.runner, max_batch=8, max_steps=4, table_width=-(-core.max_model_len // 16),
                          use_cuda_graphs=False)
    graphs.capture(progress=False)
    core.worker.graphs = graphs
    try:
        names = [None, "mlp", "attn"]  # 3 rows in bucket 4: one padded row
        outs = llm.generate([ids] * 3, GREEDY, lora_request=[loras.get(n) for n in names])
    finally:
        core.worker.graphs = None
    assert [o.token_ids for o in outs] == [want[n] for n in names]
    assert 4 in core.stats().graph_replays


def test_ngram_speculation_verifies_with_each_rows_adapter(tiny, expected):
    model, loras = tiny
    ids, want = expected
    llm = LLM(str(model), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=32,
              speculative_method="ngram", num_speculative_tokens=3, warm_up=False)
    outs = llm.generate([ids] * 3, GREEDY, lora_request=[loras["mlp"], None, loras["all"]])
    assert [o.token_ids for o in outs] == [want["mlp"], want[None], want["all"]]
    assert llm.engine.stats().spec_verify_rows > 0


def test_fp8_base_weights_take_adapters_in_the_models_dtype(tiny, expected):
    model, loras = tiny
    ids, _ = expected
    llm = LLM(str(model), device="cpu", quantization="fp8", enable_lora=True, max_loras=2, max_lora_rank=16,
              num_kv_blocks=32, warm_up=False)
    alone = {n: llm.generate([ids], GREEDY, lora_request=loras.get(n))[0].token_ids for n in (None, "all")}
    assert alone[None] != alone["all"]
    together = llm.generate([ids] * 2, GREEDY, lora_request=[None, loras["all"]])
    assert [o.token_ids for o in together] == [alone[None], alone["all"]]


def test_a_request_for_an_adapter_that_cannot_load_ends_with_the_reason(tiny, tmp_path, llm):
    _, loras = tiny
    broken = tmp_path / "broken"
    shutil.copytree(loras["attn"].path, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    out = llm.generate(["hi"], GREEDY, lora_request=LoraRequest("broken", 77, str(broken)))[0]
    assert out.finish_reason == "error" and "adapter_model.safetensors" in out.error
    assert llm.generate(["hi"], GREEDY)[0].finish_reason == "length"  # the engine goes on


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_adapters_it_cannot_serve_are_refused_naming_the_cause(tiny, tmp_path):
    model, loras = tiny
    layout = lora_layout(ModelArgs.from_dir(model))
    good = loras["all"].path
    inspect_adapter(good, layout, max_rank=16)
    with pytest.raises(AdapterError, match="rank 16 is above the maximum 8"):
        inspect_adapter(good, layout, max_rank=8)
    with pytest.raises(AdapterError, match="adapter_config.json: missing"):
        inspect_adapter(tmp_path, layout, max_rank=16)
    with pytest.raises(AdapterError, match="not found"):
        inspect_adapter(tmp_path / "nowhere", layout, max_rank=16)
    with pytest.raises(AdapterError, match="target module 'fc1' is not a projection"):
        inspect_adapter(_edit_config(good, tmp_path / "fc1", target_modules=["q_proj", "fc1"]), layout, 16)
    with pytest.raises(AdapterError, match="use_dora"):
        inspect_adapter(_edit_config(good, tmp_path / "dora", use_dora=True), layout, 16)
    with pytest.raises(AdapterError, match=r"safetensors: module layers\.0\.\w+: lora_A is \[16, (\d+)\], this model needs \[8, \1\]"):
        inspect_adapter(_edit_config(good, tmp_path / "r8", r=8), layout, 16)
    wider = dense_layout(2, 96, 64, 32, 128)  # another model's shapes
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: module layers\.0\.\w+: lora_[AB] is \[\d+, \d+\], this model needs"):
        inspect_adapter(good, wider, 16)
    moe = dense_layout(2, 64, 64, 32, 128, moe=True)
    with pytest.raises(AdapterError, match=r"target module '(gate|up|down)_proj': this is a mixture-of-experts model"):
        inspect_adapter(good, moe, 16)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(good, no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors: missing"):
        inspect_adapter(no_weights, layout, 16)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)


def test_each_module_lands_in_its_slice_of_our_fused_projections(tiny):
    from safetensors.torch import load_file

    model, loras = tiny
    layout = lora_layout(ModelArgs.from_dir(model))
    weights = load_adapter(loras["all"].path, layout, 16, torch.float32)
    tensors = load_file(f"{loras['all'].path}/adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.{}_proj.lora_{}.weight"
    assert torch.equal(weights.a["qkv"][1, 1], tensors[key.format("k", "A")])
    assert torch.equal(weights.b["qkv"][1, 64:96], tensors[key.format("k", "B")])
    assert weights.scaling == 1.0 and weights.slices == {k: tuple(range(n)) for k, n in
                                                         (("qkv", 3), ("o", 1), ("gate_up", 2), ("down", 1))}
    rs = load_adapter(loras["mlp"].path, layout, 16, torch.float32)
    assert set(rs.a) == {"gate_up", "down"} and rs.scaling == pytest.approx(4 / 8**0.5)  # rsLoRA


def test_phi3s_fused_modules_and_reordered_rotary_rows_give_peft_tokens(tmp_path):
    """Phi-3's checkpoints fuse qkv_proj and gate_up_proj: an adapter's one A serves each slice, B's rows
    span them, and with partial rotary B's q and k rows follow the base weight's reorder
    (engine/models/loading/after_load.py)."""
    model = make_tiny_model(tmp_path / "phi3", "phi3", partial_rotary_factor=0.5)
    adapter = make_adapter(model, tmp_path / "fused", seed=7, r=8, lora_alpha=16,
                           target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    ids = Tokenizer(model).encode(PROMPT)
    llm = LLM(str(model), device="cpu", enable_lora=True, max_lora_rank=8, num_kv_blocks=16, warm_up=False)
    out = llm.generate([ids], GREEDY, lora_request=LoraRequest("fused", 1, str(adapter)))[0]
    assert out.token_ids == peft_greedy(model, adapter, ids, MAX_TOKENS)
    assert out.token_ids != peft_greedy(model, None, ids, MAX_TOKENS)
