"""A converted GGUF file's projections served from its quantized blocks (--quantization gguf, CPU):
the blocks read from gguf/blocks.safetensors, each projection whose source tensors all have blocks
packed into the quantized kernel's layout (engine/cpu/quant_linear.py; cached across starts by
PackedCache), the rest left to the float32 checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from graphserve.engine.cpu import quant_linear
from graphserve.engine.cpu.packed_cache import PackedCache
from graphserve.engine.distributed import TensorParallel
from graphserve.engine.errors import InvalidConfigError, ModelFilesError
from graphserve.engine.models.layers import Linear, QuantizedParts
from graphserve.engine.models.llama import LlamaModel


def gguf_blocks(path: Path, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (GGUF type, uint8 blocks [n, bytes per row]) from a converted GGUF folder."""
    if device.type != "cpu" or dtype != torch.float32 or tp.size != 1:
        raise InvalidConfigError("--quantization gguf serves on CPU, in float32, on one rank "
                                 f"(got device {device.type}, dtype {str(dtype).split('.')[-1]}, {tp.size} ranks)")
    file = path / quant_linear.GGUF_BLOCKS_FILE
    if not file.is_file():
        raise ModelFilesError(f"{path} holds no GGUF blocks ({quant_linear.GGUF_BLOCKS_FILE}): --quantization gguf "
                              "serves a GGUF file (--model FILE.gguf) or the embedded default")
    if not quant_linear.available():
        raise InvalidConfigError("--quantization gguf needs the quantized CPU kernel, which could not be built here "
                                 "(a C compiler is needed; see the log)")
    with safe_open(str(file), framework="pt") as f:
        types = f.metadata() or {}
        return {name: (types[name], f.get_tensor(name)) for name in f.keys()}


def quantized_parts(blocks: dict[str, tuple[str, torch.Tensor]], names: list[str],
               packed: PackedCache | None) -> QuantizedParts | None:
    """The named tensors' rows, in order, in the quantized kernel's layout (neighbours of one type
    as one part), or None where one is missing or the kernel is not built here; from `packed` when
    an earlier start packed them, else packed now and added to it."""
    if not names or not all(name in blocks for name in names):
        return None
    if packed is not None and (parts := packed.get(names)) is not None:
        return parts
    groups: list[tuple[str, list[torch.Tensor]]] = []
    for name in names:
        qtype, raw = blocks[name]
        if groups and groups[-1][0] == qtype and groups[-1][1][0].shape[1] == raw.shape[1]:
            groups[-1][1].append(raw)
        else:
            groups.append((qtype, [raw]))
    parts = []
    for qtype, raws in groups:
        raw = torch.cat(raws) if len(raws) > 1 else raws[0]
        values, size = quant_linear.GGUF_BLOCKS[qtype]
        part = quant_linear.pack_quantized(raw, qtype, raw.shape[0], raw.shape[1] // size * values)
        if part is None:
            return None
        parts.append(part)
    if packed is not None:
        packed.put(names, tuple(parts))
    return tuple(parts)


def keep_quantized_projections(model: LlamaModel, blocks: dict[str, tuple[str, torch.Tensor]],
                               packed: PackedCache | None, fused: dict[str, tuple[str, int]]) -> set[str]:
    """Each projection whose source tensors all have blocks serves from them; the rest stay float32
    (fused: a checkpoint module -> our fused parameter and its index there).
    Returns the names of the weights that now hold no data (the checkpoint's floats are not needed)."""
    quantized: set[str] = set()
    if not blocks:
        return quantized
    sources: dict[str, list[str]] = {}
    for hf_module, (ours, _) in fused.items():
        sources.setdefault(ours, []).append(hf_module)
    for index, layer in enumerate(model.layers):
        for name, module in layer.named_modules():
            if isinstance(module, Linear):
                names = [f"model.layers.{index}.{source}.weight" for source in sources.get(name, [name])]
                parts = quantized_parts(blocks, names, packed)
                if parts is not None:
                    module.keep_quantized(parts)
                    quantized.add(f"layers.{index}.{name}.weight")
    return quantized
