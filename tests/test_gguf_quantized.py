"""GGUF files served with their projection weights kept quantized (`--quantization gguf`, CPU):
the conversion keeps the file's blocks (gguf/blocks.safetensors) beside the float32 weights, the
loader hands them to the quantized kernel (engine/cpu/quant_linear.py), and `--dtype float32`
without it still serves the dequantized float32 weights.

The kernel quantizes each activation row to int8 per block of 32 (as llama.cpp does), so the
served tokens are not those of the float32 path on the same weights: they are those of the
transformers model on the file's weights with each projection and the LM head run through the
kernel on the file's blocks (`kernel_reference`, which reads and reorders the blocks itself, not
through graphserve's conversion). Against the float32 path, the test bounds the disagreement."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer


gguf = pytest.importorskip("gguf", reason="gguf (gguf-py, a dependency of the CPU install) reads the files")

from graphserve import LLM, SamplingParams
from graphserve.engine.async_engine import AsyncEngine
from graphserve.engine.config import EngineConfig
from graphserve.engine.cpu import quant_linear as ql
from graphserve.engine.errors import InvalidConfigError, ModelFilesError
from graphserve.engine.model_files.model_path import ensure_gguf_model
from graphserve.engine.models.layers import Linear
from graphserve.server.app import create_app
from live_server import BackgroundServer
from tiny_gguf import gguf_cache, write_tiny_gguf  # noqa: F401 (gguf_cache: a fixture)
from tiny_models import make_tiny_model

openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")
pytestmark = pytest.mark.skipif(not ql.available(), reason="no C compiler: the quantized kernel is unavailable")

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):\n"]
MAX_TOKENS = 12
CASES = [("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q4_0")]
_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    variant, qtype = request.param
    reference, path = write_tiny_gguf(tmp_path_factory.mktemp(f"{variant}-{qtype}"), variant, qtype)
    return variant, qtype, reference, path


def kernel_reference(reference: nn.Module, path: Path, variant: str) -> nn.Module:
    """The transformers model with every projection and the LM head running the quantized kernel
    on the file's own blocks (Llama's q/k rows put back in transformers' order here)."""
    model = copy.deepcopy(reference)
    config = model.config
    names = gguf.get_tensor_name_map(_ARCHS[variant], config.num_hidden_layers)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for hf_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        name = names.get_name(hf_name + ".weight", try_suffixes=(".weight",))
        tensor = tensors.get(name) or tensors["token_embd.weight"]  # a tied LM head is the embedding table
        n, k = module.weight.shape
        raw = np.asarray(tensor.data).reshape(n, -1)
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(hf_name.split(".")[-1])
        if variant == "llama" and heads:  # llama.cpp's permutation, undone
            raw = raw.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(raw.shape)
        weight = ql.pack_quantized(raw, tensor.tensor_type.name, n, k)
        assert torch.equal(torch.from_numpy(gguf.quants.dequantize(raw, tensor.tensor_type).copy()), module.weight.data)

        def forward(x: torch.Tensor, weight=weight, bias=module.bias) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return ql.quant_linear(rows, weight, bias).reshape(*x.shape[:-1], -1)

        module.forward = forward
    return model


def greedy(model: nn.Module, prompt_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


def test_the_conversion_keeps_every_projections_blocks(tiny) -> None:
    variant, qtype, reference, path = tiny
    folder = ensure_gguf_model(path, progress=False)
    # what another server or transformers loads from the folder: the float32 weights only
    assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]
    with safe_open(str(folder / ql.GGUF_BLOCKS_FILE), framework="pt") as f:
        types, names = f.metadata(), set(f.keys())
    layers = reference.config.num_hidden_layers
    projections = {f"model.layers.{i}.{m}.weight" for i in range(layers) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert projections | {"model.embed_tokens.weight"} <= names
    assert {types[name] for name in names} == {qtype}


def test_served_tokens_are_the_kernels_on_the_files_weights(tiny) -> None:
    """Through the real server and the openai client: each greedy token is the transformers model's
    pick with the kernel in its projections, given the tokens before it (teacher-forced).

    Not its whole greedy sequence: the engine's own attention and norms round a last bit differently
    from transformers', now and then moving an activation across an int8 rounding step and a logit by
    about 1e-3 (test_quantized_and_float32_paths_agree_on_most_positions), and this tiny random model's
    two best logits are sometimes closer than that (4e-5 apart after "The quick brown fox" in Q8_0):
    such a near-tie may go either way on another CPU, and the sequences part there. So every served
    token is the reference's best or within 5e-3 of it, and nearly every one is its best exactly."""
    variant, _, reference, path = tiny
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    expected_model = kernel_reference(reference, path, variant)
    engine = AsyncEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", quantization="gguf",
                                      kv_cache_bytes=16 * 1024**2))
    below_best = []
    with BackgroundServer(create_app(engine)) as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
        for prompt in PROMPTS:
            prompt_ids = tokenizer(prompt).input_ids
            response = client.completions.create(model=path.stem, prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                                 temperature=0, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True})
            served = response.choices[0].model_extra["token_ids"]
            assert len(served) == MAX_TOKENS
            with torch.no_grad():  # the reference's logits for each served token, given the ones before it
                logits = expected_model(torch.tensor([prompt_ids + served])).logits[0, len(prompt_ids) - 1:-1]
            below_best += (logits.max(-1).values - logits[torch.arange(MAX_TOKENS), served]).tolist()
    assert max(below_best) <= 5e-3, below_best
    assert sum(gap == 0 for gap in below_best) >= 0.9 * len(below_best), below_best


def test_quantized_and_float32_paths_agree_on_most_positions(tiny) -> None:
    """Offline: the layers hold quantized weights (no float32 copy); over a long prompt the served
    log-probabilities are the kernel reference's, and the argmax agrees with the float32 path's
    (same weights, float activations) at most positions: only the activations' int8 rounding differs.

    The engine runs its own attention, norms and SiLU (C kernels per instruction set) where the
    reference runs transformers': a last-bit difference there now and then moves an activation across
    an int8 rounding step, and that position's log-probability by about 1e-3 (148 positions here: at
    most one past 1e-5 with the kernels built for AVX-512 or AVX2, five for qwen2-Q4_0 built for no
    vector paths, the largest 1.2e-3). So: nearly every position the reference's to float rounding,
    and none far from it; wrong blocks, scales or layout move them all."""
    variant, _, reference, path = tiny
    llm = LLM(model=str(path), device="cpu", dtype="float32", quantization="gguf", kv_cache_bytes=16 * 1024**2)
    model = llm.engine.core.worker.model
    projections = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert projections and all(isinstance(m.packed, tuple) for m in projections)
    assert all(m.weight.stride() == (0, 0) for m in projections)  # the float32 weight is gone
    assert isinstance(model.lm_head_packed, tuple)
    prompt = " ".join(PROMPTS * 6)
    output = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    ids = output.prompt_token_ids
    with torch.no_grad():
        kernel_logits = kernel_reference(reference, path, variant)(torch.tensor([ids])).logits[0, :-1]
        float_logits = reference(torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(kernel_logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    served = torch.tensor([lp.logprob for lp in output.prompt_logprobs[1:]])
    exact = (served - expected).abs() <= 1e-5
    assert exact.float().mean() >= 0.9, [(i, served[i].item(), expected[i].item()) for i in (~exact).nonzero()[:, 0]]
    torch.testing.assert_close(served, expected, atol=1e-2, rtol=0)
    agreement = (kernel_logits.argmax(-1) == float_logits.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement


def test_a_gguf_model_on_a_cpu_serves_its_blocks_unless_float32_is_asked_for(tiny, tmp_path: Path) -> None:
    """The default for a GGUF model on CPU, named by its file or by the folder it was converted
    into, is its quantized blocks; --dtype float32 serves its float32 weights, and so does a
    Hugging Face folder by default."""
    _, _, _, path = tiny
    folder = ensure_gguf_model(path, progress=False)
    for model in (path, folder):
        assert LLM(model=str(model), device="cpu", kv_cache_bytes=16 * 1024**2).engine.core.worker.quantization == "gguf"
    assert LLM(model=str(path), device="cpu", dtype="float32",
               kv_cache_bytes=16 * 1024**2).engine.core.worker.quantization is None
    hf_folder = make_tiny_model(tmp_path / "hf", "llama")
    assert LLM(model=str(hf_folder), device="cpu", kv_cache_bytes=16 * 1024**2).engine.core.worker.quantization is None


def test_loading_the_blocks_reads_no_float_weight_of_a_projection_they_serve(tiny, monkeypatch) -> None:
    """A start serving the blocks reads the float32 checkpoint for the embedding and norms only: the
    projections' float weights (most of the file) are not read, then dropped."""
    import graphserve.engine.models.loading.loader as loader

    _, _, _, path = tiny
    reads, read = [], loader.read_tensor
    monkeypatch.setattr(loader, "read_tensor", lambda f, name, *part, **dim: reads.append(name) or read(f, name, *part, **dim))
    llm = LLM(model=str(path), device="cpu", kv_cache_bytes=16 * 1024**2)
    assert llm.engine.core.worker.quantization == "gguf"
    assert reads and not [name for name in reads if name.endswith("_proj.weight")]
    assert "model.embed_tokens.weight" in reads


def test_a_later_start_reads_the_packed_projections_and_a_changed_file_is_packed_again(tiny, monkeypatch) -> None:
    """The first start packs the blocks for the kernel and keeps them (gguf/packed.safetensors); the next
    serves the same tokens without packing anything; blocks rewritten since are packed again; a folder
    the pack cannot be written to still serves."""
    import graphserve.engine.cpu.packed_cache as packed_cache
    from graphserve.engine.cpu.packed_cache import PACKED_FILE

    _, _, _, path = tiny
    folder = ensure_gguf_model(path, progress=False)
    (folder / PACKED_FILE).unlink(missing_ok=True)
    prompt = [[5, 6, 7, 8]]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    def start_and_generate() -> tuple[list[int], int]:
        packed, pack = [], ql.pack_quantized
        monkeypatch.setattr(ql, "pack_quantized", lambda *a: packed.append(a[1]) or pack(*a))
        llm = LLM(model=str(path), device="cpu", kv_cache_bytes=16 * 1024**2)
        assert llm.engine.core.worker.quantization == "gguf"
        return llm.generate(prompt, params)[0].token_ids, len(packed)

    tokens, packs = start_and_generate()
    assert packs > 0 and (folder / PACKED_FILE).is_file()
    assert start_and_generate() == (tokens, 0)

    blocks = folder / ql.GGUF_BLOCKS_FILE
    os.utime(blocks, ns=(blocks.stat().st_mtime_ns + 10**9,) * 2)
    assert start_and_generate() == (tokens, packs)
    assert start_and_generate() == (tokens, 0)

    def unwritable(*args, **kwargs):
        raise OSError("read-only file system")

    (folder / PACKED_FILE).unlink()
    monkeypatch.setattr(packed_cache, "save_file", unwritable)
    assert start_and_generate() == (tokens, packs)
    assert not list((folder / PACKED_FILE).parent.glob("packed*"))


def test_float32_without_the_option_serves_the_dequantized_weights(tiny) -> None:
    _, _, reference, path = tiny
    llm = LLM(model=str(path), device="cpu", dtype="float32", kv_cache_bytes=16 * 1024**2)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt_ids = tokenizer(PROMPTS[0]).input_ids
    output = llm.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
    assert list(output.token_ids) == greedy(reference, prompt_ids)


def test_the_option_is_refused_where_it_cannot_serve(tiny, tmp_path: Path) -> None:
    _, _, _, path = tiny
    with pytest.raises(InvalidConfigError, match="--quantization gguf serves on CPU, in float32"):
        LLM(model=str(path), device="cpu", dtype="bfloat16", quantization="gguf", kv_cache_bytes=16 * 1024**2)
    folder = make_tiny_model(tmp_path / "hf", "llama")  # not a GGUF conversion
    with pytest.raises(ModelFilesError, match="holds no GGUF blocks"):
        LLM(model=str(folder), device="cpu", quantization="gguf", kv_cache_bytes=16 * 1024**2)
