"""gpt-oss against transformers: a tiny random GptOssForCausalLM (sliding and full layers alternating, a
window of 8, attention sinks, q/k/v/o biases, YaRN rotary, 8 experts with biases and the clamped SwiGLU,
top 2), its weights stored in bf16 with the experts bf16 or MXFP4 as gpt-oss is released (quantized by a
reference quantizer: tests/tiny_models.quantize_mxfp4), served in float32 on the CPU: greedy tokens equal
transformers', alone and batched, prefix caching on and off, prompts longer than the window; the CUDA code
path run in Triton's interpreter gives the CPU path's logits. The MXFP4 dequantization equals transformers' bit
for bit; YaRN's frequencies equal transformers'. Unsupported variants are refused naming the field. The
reference is the same on every transformers version (tiny_models.GPT_OSS, dequantized_gpt_oss)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import (assert_greedy_matches, dequantized_gpt_oss, make_tiny_gpt_oss, quantize_mxfp4,
                         transformers_greedy)

from graphserve import LLM, SamplingParams
from graphserve.engine.errors import InvalidConfigError, ModelFilesError, UnsupportedModelError
from graphserve.engine.models.config import ModelArgs
from graphserve.kernels.mxfp4 import dequantize
from graphserve.kernels.rotary import rope_attention_factor, rope_inv_freq

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
# most longer than the window of 8 (a shared start, so a second pass hits the prefix cache)
PROMPTS = [[3 + (11 * i + 5 * j) % 400 for j in range(n)] for i, n in enumerate((6, 37, 1, 22, 45))]
PROMPTS += [PROMPTS[4][:40] + [7, 8, 9]]
EXPERTS = ("bf16", "mxfp4")


@pytest.fixture(scope="module", params=EXPERTS)
def model_dir(request, tmp_path_factory) -> Path:
    return make_tiny_gpt_oss(tmp_path_factory.mktemp(request.param) / "model", mxfp4=request.param == "mxfp4",
                             seed=3, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def hf_greedy(model_dir, tmp_path_factory) -> list[list[int]]:
    """transformers' greedy tokens in float32, its eager experts loop; for the MXFP4 model from a copy whose
    experts transformers' convert_moe_packed_tensors dequantized (tiny_models.dequantized_gpt_oss), which every
    transformers version reads in float32."""
    if "quantization_config" in json.loads((model_dir / "config.json").read_text()):
        model_dir = dequantized_gpt_oss(model_dir, tmp_path_factory.mktemp("dequantized") / "model")
    return transformers_greedy(model_dir, PROMPTS, MAX_NEW, experts_implementation="eager")


def _llm(path: Path, **config) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=96, max_num_batched_tokens=32, decode_chunk=2,
               **config)


def test_the_config_is_read_as_transformers_reads_it(model_dir):
    args = ModelArgs.from_dir(model_dir)
    assert args.layer_windows == (8, None, 8, None) and args.qkv_bias and args.gpt_oss.swiglu_limit == 7.0
    assert args.moe.num_experts == 8 and args.moe.top_k == 2 and args.moe.expert_intermediate_size == 32
    assert args.rope_scaling["rope_type"] == "yarn" and args.rope_theta == 150000.0
    assert args.quantization == ("mxfp4" if "mxfp4" in str(model_dir) else None)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_greedy_matches_transformers_alone_and_batched(model_dir, hf_greedy, prefix_caching):
    """The C attention kernel with sinks and windows, the experts in torch (MXFP4 dequantized at load)."""
    assert_greedy_matches(_llm(model_dir, prefix_caching=prefix_caching), PROMPTS, GREEDY, hf_greedy, alone=4,
                          distinct=2)


def test_the_torch_attention_fallback_matches_too(model_dir, hf_greedy):
    """Gather + the masked softmax with each head's sink column (attention.attention_with_sinks)."""
    llm = _llm(model_dir)
    for layer in llm.engine.core.worker.model.layers:
        layer.self_attn.backend.use_kernel = False
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy


def test_the_sinks_and_the_clamp_change_the_tokens(model_dir, hf_greedy, tmp_path):
    """The test means something: without the sinks (-inf: no term), or without the clamp (a limit past any
    activation), the same weights continue differently."""
    from safetensors.torch import load_file, save_file

    for what in ("sinks", "clamp"):
        dest = tmp_path / what
        shutil.copytree(model_dir, dest)
        if what == "sinks":
            weights = load_file(str(dest / "model.safetensors"))
            save_file({k: torch.full_like(v, -1e4) if k.endswith("sinks") else v for k, v in weights.items()},
                      str(dest / "model.safetensors"), metadata={"format": "pt"})
        else:
            config = json.loads((dest / "config.json").read_text())
            (dest / "config.json").write_text(json.dumps({**config, "swiglu_limit": 1e4}))
        assert [o.token_ids for o in _llm(dest).generate(PROMPTS, GREEDY)] != hf_greedy


@torch.no_grad()
def test_the_cuda_code_path_in_the_interpreter_matches_the_cpu_path(tmp_path, monkeypatch):
    """What a GPU runs, in Triton's interpreter on float32 rows: rotary + KV store, the prefill (two chunks, the
    second past the window) and decode attention kernels with the sinks, the fused norm + GEMV projections with
    their biases, routing, and the experts over the MXFP4 blocks as stored (decoded in registers), through the
    grouped, small-batch and GEMV paths -- the logits of the CPU path's (which equal transformers' above)."""
    from graphserve.engine.models import layers
    from graphserve.engine.models.attention import AttentionMetadata, TorchAttention, TritonAttention
    from graphserve.engine.models.loading.loader import load_model
    from graphserve.engine.models.moe.gpt_oss import GptOssMoE
    from graphserve.engine.sched.kv_cache import allocate_kv_cache
    from tensor_checks import rel_err

    path = make_tiny_gpt_oss(tmp_path / "mxfp4", mxfp4=True, seed=5, dtype=torch.bfloat16, num_hidden_layers=2)
    ids = torch.tensor([3 + 7 * j % 400 for j in range(21)])
    table = [3, 1]

    def meta(start: int, end: int) -> AttentionMetadata:
        slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(start, end)])
        tables, lens = torch.tensor([table], dtype=torch.int32), torch.tensor([end], dtype=torch.int32)
        if end - start == 1:
            return AttentionMetadata(is_prefill=False, slot_mapping=slots, block_tables=tables, context_lens=lens)
        return AttentionMetadata(is_prefill=True, slot_mapping=slots, block_tables=tables, context_lens=lens,
                                 cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
                                 max_seqlen_q=end - start, query_lens_host=[end - start], context_lens_host=[end])

    logits = []
    for backend, on_gpu_path in ((TorchAttention(16), False), (TritonAttention(16), True)):
        if on_gpu_path:  # the experts stay MXFP4, as the loader keeps them on a GPU
            monkeypatch.setattr(GptOssMoE, "dequantize_experts", lambda self: None)
        model = load_model(str(path), torch.float32, torch.device("cpu"), backend, 64)
        monkeypatch.setattr(layers, "_triton", lambda x, on=on_gpu_path: on)
        kv = allocate_kv_cache(model.kv_args, 4, 16, torch.float32, torch.device("cpu"))
        steps = ((0, 17), (17, 20), (20, 21))  # the experts' grouped path (17 tokens), small-batch one, GEMV
        logits.append(torch.cat([model.compute_logits(model(ids[a:b], torch.arange(a, b), meta(a, b), kv))
                                 for a, b in steps]))
        assert model.layers[0].mlp.mxfp4 == on_gpu_path
    assert rel_err(logits[1], logits[0]) < 1e-5


def test_mxfp4_dequantization_equals_transformers_bit_for_bit():
    """Every byte of packed values and every scale byte, into float32, bfloat16 and float16, against
    transformers' convert_moe_packed_tensors (which returns [E, K, N]: ours is [E, N, K])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 256, 3, 16), generator=gen, dtype=torch.uint8)
    blocks[0, :, 0] = torch.arange(256, dtype=torch.uint8)[:, None]
    scales = torch.randint(100, 150, (2, 256, 3), generator=gen, dtype=torch.uint8)
    scales[1, :, 1] = torch.arange(256, dtype=torch.uint8)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        ours = dequantize(blocks, scales, dtype)
        assert ours.shape == (2, 256, 96) and torch.equal(ours.transpose(1, 2).contiguous().view(bits),
                                                          theirs.view(bits))


def test_the_reference_quantizer_is_the_nearest_mxfp4_value():
    """tests/tiny_models.quantize_mxfp4 (the MXFP4 model's experts): each group's largest value within
    its scale's 6, every value within half a step of e2m1 of it, zeros and signs kept."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 8, 64, generator=gen) * torch.logspace(-3, 1, 8)[:, None]
    w[0, 0, :32] = 0.0
    blocks, scales = quantize_mxfp4(w)
    back = dequantize(blocks, scales)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)  # e2m1's widest step (4 to 6) is 2 units
    assert (back - w).abs().le(step).all() and torch.equal(back.sign(), w.sign() * (back != 0))
    group_amax = w.reshape(3, 8, 2, 32).abs().amax(-1)
    assert torch.equal(back[0, 0, :32], torch.zeros(32)) and (group_amax <= 6 * torch.exp2(scales.float() - 127)).all()


@pytest.mark.parametrize("scaling", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    dict(factor=4.0, original_max_position_embeddings=64),  # truncate defaults to true
    dict(factor=16.0, original_max_position_embeddings=2048, mscale=1.0, mscale_all_dim=0.5),
    dict(factor=8.0, original_max_position_embeddings=1024, attention_factor=0.8, beta_fast=16, truncate=True),
], ids=["gpt-oss", "truncate", "mscale", "attention-factor"])
def test_yarn_equals_transformers(scaling):
    """The frequencies and the cos / sin factor of kernels/rotary.py's YaRN, bit for bit those of transformers'
    _compute_yarn_parameters (the factor from the context lengths where the config gives none)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 150000.0, **{k: v for k, v in scaling.items() if v is not None}}
    hf_config = transformers.GptOssConfig(head_dim=64, max_position_embeddings=131072, rope_parameters=dict(params))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    args = ModelArgs.from_hf_config({"architectures": ["GptOssForCausalLM"], "head_dim": 64, "num_hidden_layers": 2,
                                     "max_position_embeddings": 131072, "rope_parameters": dict(params)})
    assert torch.equal(rope_inv_freq(64, args.rope_theta, args.rope_scaling), inv_freq)
    assert rope_attention_factor(args.rope_scaling) == factor and not math.isclose(factor, 1.0)


BASE = dict(architectures=["GptOssForCausalLM"], vocab_size=16, hidden_size=64, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2)


@pytest.mark.parametrize("fields,named", [
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    (dict(quantization_config={"quant_method": "mxfp4"}, intermediate_size=48), "intermediate_size"),
    (dict(swiglu_limit=0), "swiglu_limit"),
    (dict(swiglu_alpha="1.7"), "swiglu_alpha"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": -1.0}), "factor"),
])
def test_unsupported_variants_are_refused_naming_the_field(fields, named):
    with pytest.raises(UnsupportedModelError, match=named):
        ModelArgs.from_hf_config({**BASE, **fields})


def test_what_it_is_not_served_with_is_refused_at_start(model_dir):
    """CPU ranks shard gpt-oss (tests/test_tensor_parallel.py), CUDA ranks do not yet; MXFP4 experts split only
    at their blocks of 32 values (intermediate_size 32 over 2 ranks would leave 16 a rank); no quantization of
    our own."""
    from graphserve.engine.models.sharding import check_tensor_parallel

    cpu, mxfp4 = torch.device("cpu"), dict(BASE, quantization_config={"quant_method": "mxfp4"})
    check_tensor_parallel(ModelArgs.from_hf_config(BASE), 2, cpu)
    check_tensor_parallel(ModelArgs.from_hf_config(dict(mxfp4, intermediate_size=64)), 2, cpu)
    with pytest.raises(InvalidConfigError, match="intermediate_size 32 .*MXFP4 blocks"):
        check_tensor_parallel(ModelArgs.from_hf_config(mxfp4), 2, cpu)
    with pytest.raises(InvalidConfigError, match="CPU ranks only"):
        check_tensor_parallel(ModelArgs.from_hf_config(BASE), 2, torch.device("cuda"))
    with pytest.raises(InvalidConfigError, match="--quantization fp8"):
        _llm(model_dir, quantization="fp8")


def test_a_checkpoint_whose_experts_do_not_match_its_config_is_refused(model_dir, tmp_path):
    """MXFP4 blocks under a config without quant_method mxfp4 (or bf16 experts under one with it)."""
    dest = shutil.copytree(model_dir, tmp_path / "mismatch")
    config = json.loads((dest / "config.json").read_text())
    if config.pop("quantization_config", None) is None:
        config["quantization_config"] = {"quant_method": "mxfp4"}
    (dest / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFilesError, match="experts"):
        _llm(dest)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_on_cuda_matches_transformers(model_dir, hf_greedy, enforce_eager):
    """One GPU, float32: sinks and windows in the Triton prefill and decode kernels, the experts (MXFP4 as
    stored, decoded in registers) in kernels/gpt_oss_experts.py, through the graphs or eagerly."""
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=32,
              num_kv_blocks=96, enforce_eager=enforce_eager)
    assert_greedy_matches(llm, PROMPTS, GREEDY, hf_greedy)


@pytest.mark.gpu
def test_gpt_oss_20b_shapes_keep_the_grammar_and_finite_logits(tmp_path, caplog):
    """gpt-oss-20b's shapes at 2 of its 24 layers, random weights made on the GPU (load_format dummy: MXFP4
    experts and bf16 weights, as benchmarks/decode_latency.py's model), bf16, through the graphs: the warm-up burst
    (whose grammar-constrained request logged "the grammar rejected sampled token 0" on the 24-layer model:
    a masked row whose allowed logits were all NaN or -inf argmaxes to 0) rejects nothing, a JSON-schema request
    beside greedy ones returns a JSON object, and the greedy rows do not sit on token 0."""
    import gc
    import logging
    import sys

    gc.collect()  # the parity tests' engines
    torch.cuda.empty_cache()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from random_models import CONFIGS, write_tokenizer

    from graphserve.engine.structured.grammar import JSON_OBJECT_SCHEMA, GrammarSpec

    write_tokenizer(tmp_path, "gpt-oss-20b")
    config = {**CONFIGS["gpt-oss-20b"], "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="graphserve.engine"):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=16,
                  max_model_len=512, gpu_memory_utilization=0.5)
        prompts = [[(7 + 31 * i + 13 * j) % 200_000 for j in range(20 + 9 * i)] for i in range(8)]
        params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 7
        params.append(SamplingParams(max_tokens=64, temperature=0,
                                     grammar=GrammarSpec("json_schema", JSON_OBJECT_SCHEMA)))
        outs = llm.generate(prompts, params)
    assert "warmed up" in caplog.text and "grammar rejected" not in caplog.text
    assert outs[-1].finish_reason != "error"
    if outs[-1].finish_reason == "stop":  # strict=False: xgrammar lets control characters into strings
        assert isinstance(json.loads(outs[-1].text, strict=False), dict)
    assert all(o.token_ids.count(0) < len(o.token_ids) // 2 for o in outs[:-1])
