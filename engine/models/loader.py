"""Load a Hugging Face folder (config.json + single or sharded safetensors) into LlamaModel."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelFilesError
from engine.models.config import ModelArgs
from engine.models.llama import LlamaModel
from kernels.rotary import build_cos_sin_cache

# HF tensor name -> (our parameter name, shard index within a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


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
               max_positions: int) -> LlamaModel:
    path = Path(path)
    args = ModelArgs.from_dir(path)
    files = weight_files(path)
    cos_sin = build_cos_sin_cache(args.head_dim, max_positions, args.rope_theta, args.rope_scaling)
    with torch.device("meta"):
        model = LlamaModel(args, backend, cos_sin)
    model = model.to_empty(device=device).to(dtype)
    model.cos_sin = cos_sin.to(device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    _load_tensor(args, params, loaded, name, f.get_tensor(name))
    if args.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelFilesError(f"{path}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                              + (" ..." if len(missing) > 5 else ""))
    model.pack_for_cpu()
    return model.eval()


def _load_tensor(args: ModelArgs, params: dict, loaded: set, name: str, tensor: torch.Tensor) -> None:
    if "rotary_emb.inv_freq" in name:
        return
    if name == "lm_head.weight" and args.tie_word_embeddings:
        return
    target, shard = name.removeprefix("model."), None
    match = _LAYER_NAME.match(name)
    if match:
        layer, module, kind = match.groups()
        if module in _FUSED:
            fused, shard = _FUSED[module]
            target = f"layers.{layer}.{fused}.{kind}"
        else:
            target = f"layers.{layer}.{module}.{kind}"
    if target not in params:
        raise ModelFilesError(f"unexpected tensor {name!r} in checkpoint for {args.architecture}")
    param = params[target]
    if shard is not None:
        param[_shard_slices(args, target.rsplit(".", 1)[0])[shard]].copy_(tensor)
        loaded.add(f"{target}#{shard}")
        shards = 3 if "qkv" in target else 2
        if all(f"{target}#{i}" in loaded for i in range(shards)):
            loaded.add(target)
    else:
        param.copy_(tensor)
        loaded.add(target)
