"""FP8 experts on the CPU backend (float32): `--quantization fp8` on tiny random Mixtral and Qwen3-MoE
models gives transformers' greedy tokens on the same model with its FP8-covered weights (attention
projections, every expert's gate/up/down) replaced by their FP8 round trip, the router kept as it is;
a compressed-tensors FP8 checkpoint of such a model loads as written (per-channel: the tokens of
quantizing at load), and one that quantizes the router is refused. The fused kernel's FP8 path is
tests/test_moe_kernel.py's; the CUDA engine run is tests/test_moe.py's gpu test."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model, transformers_greedy, write_compressed_tensors_fp8

from graphserve import LLM, SamplingParams
from graphserve.engine.errors import ModelFilesError
from graphserve.engine.models.fp8 import FP8, dequantize, quantize_per_channel

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
PROMPTS = [[3 + (17 * i + 7 * j) % 400 for j in range(n)] for i, n in enumerate((9, 33, 2, 20))]
# the tensors FP8 covers, as the dense FP8 path does: attention projections and the experts (not the router)
QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|(mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|down_proj"
                       r"|w1|w2|w3))\.weight$")
ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.gate\.weight$")


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def model_dir(request, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", request.param, seed=11)


def hf_prompt_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probability of each prompt token after the first, teacher-forced."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def round_trip_copy(src: Path, dst: Path) -> Path:
    """The model folder with each FP8-covered weight replaced by dequantize(quantize(w)), float32."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    assert any(".experts." in name and QUANTIZED.search(name) for name in tensors)  # the pattern finds them
    for name, t in tensors.items():
        if QUANTIZED.search(name):
            tensors[name] = dequantize(*quantize_per_channel(t), torch.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_quantization_fp8_gives_the_greedy_tokens_of_the_fp8_round_trip(model_dir, tmp_path):
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, decode_chunk=2,
              quantization="fp8")
    mlp = llm.engine.core.worker.model.layers[1].mlp
    experts, inter = mlp.moe.num_experts, mlp.moe.expert_intermediate_size
    assert mlp.gate_up_proj.dtype == mlp.down_proj.dtype == FP8
    assert mlp.gate_up_scale.shape == (experts, 2 * inter) and mlp.down_scale.shape == (experts, 64)
    assert mlp.gate_up_scale.dtype == torch.float32 and mlp.gate_up_scale.min() > 0
    assert llm.engine.core.worker.model.layers[0].self_attn.o_proj.weight.dtype == FP8
    router = next(t for name, t in load_file(str(model_dir / "model.safetensors")).items()
                  if ROUTER.search(name) and ".layers.1." in name)
    assert torch.equal(mlp.router.weight, router), "the router stays in the model's dtype, unquantized"
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    round_trip = round_trip_copy(model_dir, tmp_path / "round_trip")
    want = transformers_greedy(round_trip, PROMPTS, MAX_NEW)
    assert got == want
    assert len({tuple(t) for t in want}) > 1
    # teacher-forced: the round trip's numbers (float32 sums apart), visibly not the unquantized model's
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    served = torch.tensor([p.logprob for p in out.prompt_logprobs[1:]])
    torch.testing.assert_close(served, hf_prompt_logprobs(round_trip, prompt), rtol=0, atol=1e-4)
    assert (served - hf_prompt_logprobs(model_dir, prompt)).abs().max() > 1e-3


def write_fp8_checkpoint(src: Path, dst: Path, strategy: str, quantize_router: bool = False) -> dict:
    """The folder re-written as llm-compressor writes an FP8 MoE checkpoint: the covered weights in
    e4m3 with `weight_scale` ([out, 1] per channel, or one per tensor), the router left out
    (ignore re:.*mlp.gate$) unless quantize_router."""
    return write_compressed_tensors_fp8(
        src, dst, lambda name: bool(QUANTIZED.search(name) or (quantize_router and ROUTER.search(name))), strategy,
        ignore=["lm_head"] + ([] if quantize_router else ["re:.*mlp.gate$"]))


def expert_tensor(arch_names: dict, layer: int, expert: int, proj: str) -> str:
    """The checkpoint name of one expert's projection (proj: gate / up / down), whichever naming it uses."""
    mixtral = {"gate": "w1", "up": "w3", "down": "w2"}
    for name in arch_names:
        if f"layers.{layer}." in name and f"experts.{expert}." in name and name.endswith(".weight") and (
                f".{proj}_proj." in name or f".{mixtral[proj]}." in name):
            return name
    raise KeyError(proj)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_a_compressed_tensors_fp8_moe_checkpoint_loads_as_written(model_dir, tmp_path, strategy):
    written = write_fp8_checkpoint(model_dir, tmp_path / strategy, strategy)
    llm = LLM(str(tmp_path / strategy), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, decode_chunk=2)
    mlp = llm.engine.core.worker.model.layers[1].mlp
    inter = mlp.moe.expert_intermediate_size
    for expert in (0, mlp.moe.num_experts - 1):
        up, down = (expert_tensor(written, 1, expert, p) for p in ("up", "down"))
        assert torch.equal(mlp.gate_up_proj[expert, inter:].view(torch.uint8), written[up].view(torch.uint8))
        assert torch.equal(mlp.down_proj[expert].view(torch.uint8), written[down].view(torch.uint8))
        assert torch.equal(mlp.gate_up_scale[expert, inter:], written[up + "_scale"].flatten().expand(inter))
        assert torch.equal(mlp.down_scale[expert], written[down + "_scale"].flatten().expand(64))
    if strategy == "channel":  # the same weights as quantizing the original at load: the same tokens
        at_load = LLM(str(model_dir), device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, decode_chunk=2,
                      quantization="fp8")
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == \
               [o.token_ids for o in at_load.generate(PROMPTS, GREEDY)]
    else:  # one scale per tensor: gate and up of an expert each have their own
        gate_scales, up_scales = mlp.gate_up_scale[0, :inter], mlp.gate_up_scale[0, inter:]
        assert torch.unique(gate_scales).numel() == torch.unique(up_scales).numel() == 1
        assert gate_scales[0] != up_scales[0]


def test_a_checkpoint_that_quantizes_the_router_is_refused(model_dir, tmp_path):
    write_fp8_checkpoint(model_dir, tmp_path / "router", "channel", quantize_router=True)
    with pytest.raises(ModelFilesError, match="router"):
        LLM(str(tmp_path / "router"), device="cpu", num_kv_blocks=64)


def test_each_rank_loads_its_slice_of_the_fp8_experts_and_scales(model_dir, tmp_path):
    """Tensor parallelism (CPU ranks): each of two ranks holds its half of every expert's gate/up rows
    with their scales, and its half of the down columns with every down row's scale."""
    from graphserve.engine.distributed import TensorParallel
    from graphserve.engine.models.attention import TorchAttention
    from graphserve.engine.models.loading.loader import load_model

    path = tmp_path / "fp8"
    write_fp8_checkpoint(model_dir, path, "channel")

    def experts(tp: TensorParallel):
        mlp = load_model(path, torch.float32, torch.device("cpu"), TorchAttention(16), 512, tp=tp).layers[1].mlp
        return mlp.gate_up_proj.view(torch.uint8), mlp.gate_up_scale, mlp.down_proj.view(torch.uint8), mlp.down_scale

    whole = experts(TensorParallel())
    inter = whole[0].shape[1] // 2
    for rank in (0, 1):
        gate_up, gate_up_scale, down, down_scale = experts(TensorParallel(rank=rank, size=2))
        half = inter // 2
        rows = torch.cat([torch.arange(rank * half, (rank + 1) * half),
                          inter + torch.arange(rank * half, (rank + 1) * half)])
        assert torch.equal(gate_up, whole[0][:, rows]) and torch.equal(gate_up_scale, whole[1][:, rows])
        assert torch.equal(down, whole[2][:, :, rank * half:(rank + 1) * half])
        assert torch.equal(down_scale, whole[3])
