"""Our decoder vs transformers' implementation on tiny random-weight models; one decoder layer on
the Triton path (in the interpreter)."""

import importlib

import pytest
import torch
import transformers
from tensor_checks import rel_err
from tiny_models import VARIANTS, make_tiny_model

from graphserve.engine.models.attention import AttentionMetadata, TorchAttention
from graphserve.engine.models.loading.loader import load_model
from graphserve.engine.sched.kv_cache import allocate_kv_cache


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", request.param)
    ours = load_model(path, torch.float32, torch.device("cpu"), TorchAttention(16), 512)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, ours, ref


def _prefill_meta(slots, table, query_len, context_len):
    return AttentionMetadata(
        is_prefill=True, slot_mapping=torch.tensor(slots), block_tables=torch.tensor([table], dtype=torch.int32),
        context_lens=torch.tensor([context_len], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, query_len], dtype=torch.int32), max_seqlen_q=query_len,
        query_lens_host=[query_len], context_lens_host=[context_len])


@torch.no_grad()
def test_prefill_logits_match_transformers(tiny):
    _, ours, ref = tiny
    torch.manual_seed(1)
    ids = torch.randint(3, 500, (45,))
    kv = allocate_kv_cache(ours.args, 8, 16, torch.float32, torch.device("cpu"))
    table = [5, 2, 7]  # non-contiguous blocks
    slots = [table[p // 16] * 16 + p % 16 for p in range(45)]
    logits = ours.compute_logits(ours(ids, torch.arange(45), _prefill_meta(slots, table, 45, 45), kv))
    expected = ref(ids[None]).logits[0].float()
    assert rel_err(logits, expected) < 1e-5
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@torch.no_grad()
def test_chunked_prefill_then_decode_match_transformers(tiny):
    """A prompt computed in two chunks, then token-by-token decode over the paged cache."""
    _, ours, ref = tiny
    torch.manual_seed(2)
    ids = torch.randint(3, 500, (40,))
    expected = ref(ids[None]).logits[0].float()
    kv = allocate_kv_cache(ours.args, 8, 16, torch.float32, torch.device("cpu"))
    table = [3, 6, 1]
    slot = lambda p: table[p // 16] * 16 + p % 16
    got = []
    for start, end in ((0, 20), (20, 33)):
        meta = _prefill_meta([slot(p) for p in range(start, end)], table, end - start, end)
        got.append(ours.compute_logits(ours(ids[start:end], torch.arange(start, end), meta, kv)))
    for p in range(33, 40):
        meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([slot(p)]),
                                 block_tables=torch.tensor([table], dtype=torch.int32),
                                 context_lens=torch.tensor([p + 1], dtype=torch.int32))
        got.append(ours.compute_logits(ours(ids[p:p + 1], torch.tensor([p]), meta, kv)))
    assert rel_err(torch.cat(got), expected) < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("variant", ["qwen3", "qwen2"])  # q/k norm; QKV bias and tied embeddings
def test_triton_path_matches_torch_path(monkeypatch, tmp_path, variant):
    """The CUDA code path (Triton kernels for norms, rotary, SiLU, KV store and paged
    attention; the decode step's projections as fused norm + GEMV (+ SiLU) kernels), run in
    Triton's interpreter on CPU, equals the torch path."""
    from graphserve.engine.models import layers
    from graphserve.engine.models.attention import TritonAttention

    path = make_tiny_model(tmp_path / variant, variant)
    torch_model = load_model(path, torch.float32, torch.device("cpu"), TorchAttention(16), 128)
    triton_model = load_model(path, torch.float32, torch.device("cpu"), TritonAttention(16), 128)
    ids = torch.randint(3, 500, (21,), generator=torch.Generator().manual_seed(0))
    table = [4, 1]
    slot = lambda p: table[p // 16] * 16 + p % 16
    results = []
    for model, use_triton in ((torch_model, False), (triton_model, True)):
        monkeypatch.setattr(layers, "_triton", lambda x, use=use_triton: use)
        kv = allocate_kv_cache(model.args, 6, 16, torch.float32, torch.device("cpu"))
        meta = _prefill_meta([slot(p) for p in range(20)], table, 20, 20)
        prefill = model.compute_logits(model(ids[:20], torch.arange(20), meta, kv))
        meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([slot(20)]),
                                 block_tables=torch.tensor([table], dtype=torch.int32),
                                 context_lens=torch.tensor([21], dtype=torch.int32))
        decode = model.compute_logits(model(ids[20:21], torch.tensor([20]), meta, kv))
        results.append((prefill, decode, torch.stack([torch.stack(layer) for layer in kv])))
    for got, want in zip(results[1], results[0]):  # prefill logits, decode logits, the whole KV cache
        assert rel_err(got, want) < 1e-5


def one_layer_decode(monkeypatch, intermediate: int, num_heads: int = 2):
    """A Llama decoder layer (hidden 128, num_heads heads of 64, one KV head; float32, random weights) and
    a function that runs decode of 4 rows through it on the Triton path (in the interpreter: the
    interpreter's bf16 dot is not exact), on fresh copies of one paged KV cache each time."""
    from graphserve.engine.models import layers
    from graphserve.engine.models.attention import AttentionMetadata, TritonAttention
    from graphserve.engine.models.config import ModelArgs
    from graphserve.engine.models.llama import DecoderLayer
    from graphserve.kernels.rotary import build_cos_sin_cache

    monkeypatch.setattr(layers, "_triton", lambda x: True)
    args = ModelArgs("LlamaForCausalLM", vocab_size=256, hidden_size=128, intermediate_size=intermediate,
                     num_layers=1, num_heads=num_heads, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6,
                     rope_theta=10000.0,
                     rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=False,
                     qk_norm=False, dtype="float32", eos_token_ids=(0,), bos_token_id=None)
    torch.manual_seed(5)
    layer = DecoderLayer(args, TritonAttention(block_size=16))
    for module in layer.modules():
        if isinstance(module, layers.Linear):
            module.weight.data = torch.randn(module.weight.shape) / module.in_features**0.5
    gen = torch.Generator().manual_seed(6)
    rows, blocks = 4, 4
    x, residual = (torch.randn(rows, 128, generator=gen) for _ in range(2))
    context_lens = torch.tensor([5, 17, 33, 64], dtype=torch.int32)
    block_tables = (torch.arange(rows * blocks, dtype=torch.int32).view(rows, blocks) + 1)
    positions = context_lens.long() - 1
    slot_mapping = block_tables.long().gather(1, (positions // 16)[:, None])[:, 0] * 16 + positions % 16
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slot_mapping, block_tables=block_tables,
                             context_lens=context_lens)
    caches = [torch.randn(rows * blocks + 1, 16, 1, 64, generator=gen) for _ in range(2)]
    cos_sin = build_cos_sin_cache(64, 256, 10000.0)

    def run():
        k_cache, v_cache = (c.clone() for c in caches)
        return layer(x, residual, positions, cos_sin, meta, k_cache, v_cache)

    return layer, run


def test_the_norm_after_a_split_projection_sums_it_and_changes_no_bit(monkeypatch):
    """layers.DEFER_SPLIT_REDUCE: down_proj (K 2048, split in two by the skinny GEMM) hands its
    partials to the residual-add + norm after it (here the model's final add_rms_norm) instead of
    running its reduce kernel: the same bits as with the reduce kernel. (The skinny GEMM with float32
    operands: the engine gives it bf16 / fp16, whose dot the interpreter does not compute exactly. FP8
    projections take a CPU path here; tests/test_skinny_gemm.py holds the FP8 partials to the bit.)"""
    from graphserve.engine.models import layers

    skinny = importlib.import_module("graphserve.kernels.skinny_gemm")  # the package exports a function of that name
    reduces = []
    real_finish = skinny.finish_split
    monkeypatch.setattr(skinny, "finish_split", lambda p, *a: reduces.append(p.shape) or real_finish(p, *a))
    layer, run = one_layer_decode(monkeypatch, intermediate=2048)
    monkeypatch.setattr(layers, "_skinny_applies", lambda x, lm_head: not lm_head and 2 <= x.shape[0] <= 64)
    norm_weight = torch.rand(128, generator=torch.Generator().manual_seed(7)) + 0.5
    results = {}
    for defer in (True, False):
        monkeypatch.setattr(layers, "DEFER_SPLIT_REDUCE", defer)
        reduces.clear()
        out, residual = run()
        assert isinstance(out, skinny.SplitPartials) == defer
        results[defer] = layers.add_rms_norm(out, residual, norm_weight, 1e-6)
        assert reduces == ([] if defer else [(4, 128)])  # down_proj's split; o_proj's K of 128 is not split
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))


def assert_amaxed_input_changes_no_bit(monkeypatch, layer, run, proj_name: str, switch: str) -> None:
    """With the layer's projections in FP8 and layers.<switch> off, then on: on, the projection named
    proj_name (a dotted path in the layer) takes its input as AmaxedRows (the same rows as off), and its
    output is bit for bit the W8A8 product of those rows quantized whole."""
    from graphserve.engine.models import layers
    from graphserve.engine.models.fp8 import fp8_gemm
    from graphserve.kernels.fp8_quant import AmaxedRows, quantize_rows_fp8

    for module in layer.modules():
        if isinstance(module, layers.Linear):
            module.to_fp8()
    proj = layer.get_submodule(proj_name)
    seen = []
    real_forward = proj.forward
    monkeypatch.setattr(proj, "forward", lambda x, **kw: seen.append((x, real_forward(x, **kw))) or seen[-1][1])
    inputs = {}
    for on in (False, True):
        monkeypatch.setattr(layers, switch, on)
        seen.clear()
        run()
        (inputs[on], output), = seen
    assert isinstance(inputs[True], AmaxedRows) and isinstance(inputs[False], torch.Tensor)
    assert torch.equal(inputs[True].rows, inputs[False])
    want = fp8_gemm(*quantize_rows_fp8(inputs[False]), proj.weight, proj.weight_scale, None, torch.float32,
                    defer_reduce=True)
    assert torch.equal(layers._summed(output), layers._summed(want))


def test_decode_attention_hands_an_fp8_o_proj_its_rows_amax_and_changes_no_bit(monkeypatch):
    """layers.FP8_ATTENTION_AMAX: with FP8 projections on the Triton path (in the interpreter), decode
    attention (one split here) hands o_proj its output as AmaxedRows (the same rows) and o_proj's row
    quantization reads each row's amax from its KV heads' parts: bit for bit the W8A8 product of those
    rows quantized as they are otherwise (32 heads: o_proj's K of 2048 takes the row-chunk path, which reads
    the parts)."""
    layer, run = one_layer_decode(monkeypatch, intermediate=256, num_heads=32)
    assert_amaxed_input_changes_no_bit(monkeypatch, layer, run, "self_attn.o_proj", "FP8_ATTENTION_AMAX")


def test_an_fp8_gate_up_hands_down_proj_its_rows_amax_and_changes_no_bit(monkeypatch):
    """layers.FP8_ROW_AMAX: with FP8 projections on the Triton path (in the interpreter), gate_up hands
    down_proj its output as AmaxedRows (the same rows) and down_proj's row quantization reads each
    row's amax from them (intermediate 2048: the row-chunk path): bit for bit the W8A8 product of
    those rows quantized as they are otherwise. (Off, down_proj takes FP8's CPU path here, x.is_cuda
    being false: no reference for the bits.)"""
    layer, run = one_layer_decode(monkeypatch, intermediate=2048)
    assert_amaxed_input_changes_no_bit(monkeypatch, layer, run, "mlp.down_proj", "FP8_ROW_AMAX")


def test_loading_and_decoding_never_import_torch_dynamo(tmp_path):
    """Every engine start loads a model: nothing on that path (nor a decode step) may initialize
    weights the checkpoint replaces on the meta device, whose torch normal_ imports torch._dynamo,
    seconds of every start."""
    import subprocess
    import sys

    path = make_tiny_model(tmp_path / "llama", "llama")
    script = ("import sys\nfrom graphserve import LLM, SamplingParams\n"
              f"llm = LLM({str(path)!r}, device='cpu', num_kv_blocks=16)\n"
              "llm.generate(['hi'], SamplingParams(max_tokens=2))\n"
              "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"
