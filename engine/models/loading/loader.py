"""Load a Hugging Face folder (config.json + single or sharded safetensors) into LlamaModel.
A mixture of experts' per-expert tensors are stacked into [E, ...] parameters (loading/moe_weights.py).
quantization "gguf" (a converted GGUF folder, CPU): the projections and the LM head served from the
file's quantized blocks (gguf/blocks.safetensors, engine/cpu/quant_linear.py), not float32.

Under tensor parallelism each rank reads only its own slice of every split weight
(safetensors slices read just those bytes): rows for the column-parallel projections and the
vocabulary, columns for the row-parallel ones (engine/distributed.py says which); of a checkpoint's
fused tensor (Phi-3's qkv_proj and gate_up_proj) the rows of each of its parts; of gpt-oss's stacked
experts each expert's intermediate columns (loading/gpt_oss_weights.expert_slice). A row-parallel bias
(gpt-oss's o_proj and experts' down) is read by rank 0 only, the others holding zeros (Shard.holds_row_biases)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from graphserve.engine.cpu.packed_cache import PackedCache
from graphserve.engine.distributed import SINGLE, TensorParallel
from graphserve.engine.errors import ModelFilesError
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.models.cpu_stack import stack_decoder
from graphserve.engine.models.hf_config.gemma3 import checkpoint_name
from graphserve.engine.models.hf_config.moe import check_moe_servable
from graphserve.engine.models.layers import Linear
from graphserve.engine.models.llama import LlamaModel
from graphserve.engine.models.loading.after_load import after_load
from graphserve.engine.models.loading.gguf_projections import gguf_blocks, keep_quantized_projections, quantized_parts
from graphserve.engine.models.loading.gpt_oss_weights import copy_expert_tensor, expert_slice, expert_target
from graphserve.engine.models.loading.moe_weights import (ROUTER_NAMES, SCALES, complete_stacks, copy_expert,
                                                          copy_expert_scale, expert_slot, part_name)
from graphserve.engine.models.moe.sparse import SparseMoE
from graphserve.engine.models.sharding import Shard
from graphserve.kernels.rotary import build_cos_sin_cache

# HF tensor name -> (our parameter name, shard index within a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# a checkpoint's own fused projections (Phi-3's): [q; k; v] and [gate; up] rows, as ours
_CHECKPOINT_FUSED = ("self_attn.qkv_proj", "mlp.gate_up_proj")
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
_ROUTER = "mlp.router"
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias|weight_scale|sinks)$")

Span = tuple[int, int]  # [start, end) along one dimension


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise ModelFilesError(f"{path} has no safetensors weights" + (f" (missing {missing[0].name})" if missing else ""))
    return files


def _shard_slices(args: ModelArgs, fused_name: str) -> list[slice]:
    if fused_name.endswith("qkv_proj"):
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)]
    inter = args.intermediate_size
    return [slice(0, inter), slice(inter, 2 * inter)]


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device, backend,
               max_positions: int, tp: TensorParallel = SINGLE, quantization: str | None = None,
               load_format: str = "safetensors") -> LlamaModel:
    """quantization "fp8": the projections' weights in FP8 (engine/models/fp8.py), quantized here
    unless the checkpoint holds them so already; "gguf": the projections and LM head kept as a
    converted GGUF file's quantized blocks (CPU, float32, one rank). load_format "dummy": random
    weights made on the device, no weight file read (config.json and the tokenizer are still the
    folder's)."""
    path = Path(path)
    args = ModelArgs.from_dir(path)
    check_moe_servable(args.architecture, args.moe, args.quantization, device, quantization)
    # refused (device, dtype, ranks, no blocks) before any weight is read
    blocks = gguf_blocks(path, dtype, device, tp) if quantization == "gguf" else {}
    files = weight_files(path) if load_format != "dummy" else []
    cos_sin = build_cos_sin_cache(args.head_dim, max_positions, args.rope_theta, args.rope_scaling,
                                  rotary_dim=args.rotary_dim)
    with torch.device("meta"):
        model = LlamaModel(args, backend, cos_sin, tp)
    # in the model's dtype while still on meta: a float32 copy first would need twice the memory. torch.empty,
    # not Module.to_empty: its empty_like of a meta tensor imports torch.fx's symbolic shapes (~0.7 s a start)
    model = model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.cos_sin = cos_sin.to(device)
    # what FP8 covers: the projections and the routed experts, not an MoE router (kept in the model's dtype)
    to_fp8 = [m for name, m in model.layers.named_modules()
              if isinstance(m, SparseMoE) or (isinstance(m, Linear) and not name.endswith(_ROUTER))]
    prequantized = args.quantization == "fp8" and load_format != "dummy"
    if prequantized:  # empty FP8 weights and scales, for the checkpoint to fill
        for module in to_fp8:
            module.to_fp8(quantize=False)
    # projections served from GGUF blocks first: their float weights are then not read at all
    packed = PackedCache(path) if blocks else None
    quantized = keep_quantized_projections(model, blocks, packed, _FUSED)
    if load_format == "dummy":
        _fill_random(model, seed=tp.rank)
    else:
        _read_checkpoint(model, path, files, skip=quantized)
    after_load(model, args, max_positions, device, dummy=load_format == "dummy")
    if quantization == "fp8" and not prequantized:
        for module in to_fp8:
            module.to_fp8()
    model.pack_for_cpu()
    head = quantized_parts(blocks, ["model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"], packed)
    if head is not None:  # (a tied table stays float32 too, for the embedding lookup)
        model.lm_head_packed = head
    if packed is not None:
        packed.save()
    model.cpu_stack = stack_decoder(model)
    return model.eval()


def _read_checkpoint(model: LlamaModel, path: Path, files: list[Path], skip: set[str] = frozenset()) -> None:
    """Every parameter from the safetensors files (this rank's slices) but those in `skip` (served
    otherwise), or ModelFilesError."""
    params = dict(model.named_parameters())
    loaded: set[str] = set(skip)
    with torch.no_grad():
        if model.shard.vocab_rows > model.shard.vocab[1] - model.shard.vocab[0]:  # the last rank's padding
            model.embed_tokens.weight.zero_()
            if model.lm_head is not None:
                model.lm_head.weight.zero_()
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    _load_tensor(model.shard, params, loaded, name, f)
    if model.args.tie_word_embeddings:
        loaded.add("lm_head.weight")
    loaded |= complete_stacks(params, loaded)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelFilesError(f"{path}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                              + (" ..." if len(missing) > 5 else ""))


def _fill_random(model: LlamaModel, seed: int) -> None:
    """Norms 1, biases and matrices N(0, 0.02), the embedding and LM head N(0, 0.5) (as
    benchmarks/random_models.py writes them), drawn on the parameters' device. MXFP4 experts: random
    bytes, scales 2^-9 to 2^-7 (values of about that N(0, 0.02)'s size)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == torch.uint8:
                p.random_(0, 256, generator=gen) if name.endswith("blocks") else p.random_(118, 121, generator=gen)
            elif p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02, generator=gen)
            else:
                p.normal_(0, 0.5 if "embed_tokens" in name or "lm_head" in name else 0.02, generator=gen)


class _Renamed:
    """A safetensors file whose tensor `hf_name` is read as `name` (Gemma 3's language_model. prefix)."""

    def __init__(self, f, name: str, hf_name: str):
        self.f, self.name, self.hf_name = f, name, hf_name

    def get_slice(self, name: str):
        return self.f.get_slice(self.hf_name if name == self.name else name)


def read_tensor(f, name: str, span: Span | None = None, dim: int = 0) -> torch.Tensor:
    """[a, b) of a checkpoint tensor along `dim` (span None: all of it), reading only those bytes."""
    sliced = f.get_slice(name)
    if span is None:
        return sliced[:]
    return sliced[(slice(None),) * dim + (slice(*span),)]


def _read_rows(f, name: str, rows: list[Span]) -> torch.Tensor:
    """The rows of each span, in order (the parts of a fused tensor; adjacent spans read at once)."""
    merged: list[Span] = []
    for a, b in rows:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    parts = [read_tensor(f, name, span) for span in merged]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _fused_rows(shard: Shard, module: str) -> list[Span]:
    """This rank's rows of a checkpoint's fused projection: its q, k and v heads' (qkv_proj) or its
    intermediate columns' gate and up rows (gate_up_proj), each part at its offset in the whole tensor."""
    whole, d = shard.whole, shard.whole.head_dim
    if module == "self_attn.qkv_proj":
        q, kv = whole.num_heads * d, whole.num_kv_heads * d
        (qa, qb), (ka, kb) = shard.q_heads, shard.kv_heads
        return [(qa * d, qb * d), (q + ka * d, q + kb * d), (q + kv + ka * d, q + kv + kb * d)]
    a, b = shard.inter
    return [(a, b), (whole.intermediate_size + a, whole.intermediate_size + b)]


def _split(shard: Shard, module: str, kind: str) -> tuple[list[Span] | None, Span | None]:
    """(row spans, columns) of the HF tensor `module`.`kind` that this rank holds (None: all of them;
    rows [] for a row-parallel bias another rank adds: none)."""
    d = shard.local.head_dim
    heads = {"self_attn.q_proj": shard.q_heads, "self_attn.k_proj": shard.kv_heads, "self_attn.v_proj": shard.kv_heads}
    if module in heads:
        a, b = heads[module]
        return [(a * d, b * d)], None
    if module in ("mlp.gate_proj", "mlp.up_proj"):
        return [shard.inter], None
    if module in _CHECKPOINT_FUSED:
        return _fused_rows(shard, module), None
    if kind == "sinks":  # one per query head
        return [shard.q_heads], None
    if kind == "bias":
        return (None if shard.holds_row_biases or module not in _ROW_PARALLEL else []), None
    if module == "self_attn.o_proj":
        return None, (shard.q_heads[0] * d, shard.q_heads[1] * d)
    if module == "mlp.down_proj":
        return None, shard.inter
    return None, None


def _load_tensor(shard: Shard, params: dict, loaded: set, name: str, f) -> None:
    args = shard.local
    if args.gemma is not None:  # a multimodal checkpoint's text tower; its vision tower is not loaded
        hf_name, name = name, checkpoint_name(name)
        if name is None:
            return
        if hf_name != name:
            f = _Renamed(f, name, hf_name)
    if "rotary_emb.inv_freq" in name or name.endswith(".input_scale"):  # activations: scaled per token instead
        return
    if args.gpt_oss is not None and (target := expert_target(name)) is not None:  # stacked experts
        if target not in params:
            raise ModelFilesError(f"unexpected tensor {name!r} in checkpoint for {args.architecture} (its config's "
                                  f"quantization_config says {args.quantization or 'none'})")
        part = expert_slice(name, shard.inter)
        if part is None and not shard.holds_row_biases:  # the down projection's bias: rank 0 adds it
            params[target].data.zero_()
        else:
            copy_expert_tensor(params[target].data, name, read_tensor(f, name, *part) if part else read_tensor(f, name))
        loaded.add(target)
        return
    if name == "lm_head.weight" and args.tie_word_embeddings:
        return
    target, fused_shard, rows, cols = name.removeprefix("model."), None, None, None
    match = _LAYER_NAME.match(name)
    if match:
        layer, module, kind = match.groups()
        slot = expert_slot(module)
        if slot is not None:  # one expert's projection, into its rows of the layer's stacked parameter
            target = f"layers.{layer}.{slot.param if kind == 'weight' else SCALES[slot.param]}"
            if kind not in ("weight", "weight_scale") or target not in params:
                raise ModelFilesError(f"unexpected tensor {name!r} in checkpoint for {args.architecture}")
            rows, cols = (shard.inter, None) if slot.half is not None else (None, shard.inter)  # this rank's columns
            if kind == "weight":
                tensor = read_tensor(f, name, rows) if rows is not None else read_tensor(f, name, cols, dim=1)
                copy_expert(params[target].data, slot, tensor, name)
            else:  # a scale per output row: split like the weight's rows (down's rows are all kept)
                copy_expert_scale(params[target].data, slot, read_tensor(f, name), rows, name)
            loaded.add(part_name(target, slot.expert, slot.half))
            return
        module = ROUTER_NAMES.get(module, module)
        if module == _ROUTER and kind == "weight_scale":
            raise ModelFilesError(f"{name}: the checkpoint quantizes the MoE router; graphserve keeps the router "
                                  "in the model's dtype (llm-compressor's MoE recipes leave it out: "
                                  "ignore re:.*mlp.gate$)")
        # a weight_scale (one per output row) is split like its weight's rows
        rows, cols = _split(shard, module, "weight" if kind == "weight_scale" else kind)
        if module in _FUSED:
            fused, fused_shard = _FUSED[module]
            target = f"layers.{layer}.{fused}.{kind}"
        else:
            target = f"layers.{layer}.{module}.{kind}"
    elif target in ("embed_tokens.weight", "lm_head.weight"):
        rows = [shard.vocab]
    if target not in params:
        raise ModelFilesError(f"unexpected tensor {name!r} in checkpoint for {args.architecture}")
    if target in loaded:  # served from elsewhere (GGUF blocks): not read
        return
    param = params[target]
    if rows == []:  # none of it on this rank (a row-parallel bias rank 0 adds): zeros, nothing read
        param.zero_()
        loaded.add(target)
        return
    if name.endswith(".weight_scale"):  # [out, 1], [out], or one for the whole tensor (tiny: read whole)
        tensor = read_tensor(f, name).float().flatten()
        if tensor.numel() == 1:
            span = (_shard_slices(args, target.rsplit(".", 1)[0])[fused_shard] if fused_shard is not None
                    else slice(0, param.shape[0]))
            tensor = tensor.expand(span.stop - span.start)
        elif rows is not None:  # the column-parallel projections' rows (row-parallel ones keep every row)
            tensor = torch.cat([tensor[a:b] for a, b in rows])
    elif rows is not None:
        tensor = _read_rows(f, name, rows)
    else:
        tensor = read_tensor(f, name, cols, dim=1)
    if fused_shard is not None:
        param[_shard_slices(args, target.rsplit(".", 1)[0])[fused_shard]].copy_(tensor)
        loaded.add(f"{target}#{fused_shard}")
        shards = 3 if "qkv" in target else 2
        if all(f"{target}#{i}" in loaded for i in range(shards)):
            loaded.add(target)
    else:
        param[:tensor.shape[0]].copy_(tensor)  # the vocabulary's last rank holds padding rows past it
        loaded.add(target)
