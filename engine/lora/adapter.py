"""A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors): its config read,
its tensors checked against the base model's layout without reading them (the front end checks an
adapter this way before any request uses it), and its weights loaded into our fused layout.

The config is read here, not by peft's LoraConfig: serving needs a handful of its fields, and every
field that would change the product (DoRA, biases, per-module ranks, ...) is refused by name."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from graphserve.engine.errors import AdapterError
from graphserve.engine.lora.layout import KINDS, LoraLayout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (any prefix before `layers`)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.((?:[\w]+\.)*?)(\w+)\.lora_(A|B)\.weight$")
# PEFT fields that change the product an adapter adds, with the value that leaves it plain LoRA
_PLAIN = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none", "modules_to_save": None,
          "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None, "use_qalora": False}


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str | None  # a list of names, a regex, "all-linear"; None: from the weights

    @property
    def scaling(self) -> float:
        """What B @ A @ x is multiplied by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


@dataclass
class AdapterWeights:
    """An adapter's weights in our layout, on the host: per projection kind it changes, A [layers, slices,
    r, in] and B [layers, out, r] (zeros where it leaves a layer or slice alone), and per kind the slices
    it covers."""

    rank: int
    scaling: float
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    slices: dict[str, tuple[int, ...]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


def read_config(folder: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter's config, checked: a plain LoRA of rank 1..max_rank."""
    path = Path(folder) / CONFIG_FILE
    if not Path(folder).is_dir():
        raise AdapterError(f"LoRA adapter folder not found: {folder}")
    if not path.is_file():
        raise AdapterError(f"{path}: missing (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {raw.get('peft_type')!r}: only LoRA adapters are served")
    for name, plain in _PLAIN.items():
        value = raw.get(name)
        if not (value is None or value == plain or (not value and not plain)):
            raise AdapterError(f"{path}: {name} = {value!r} is not supported (graphserve serves plain LoRA)")
    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} is above the maximum {max_rank} (--max-lora-rank)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        targets = tuple(targets)
    elif targets is not None and not isinstance(targets, str):
        raise AdapterError(f"{path}: target_modules must be a list of names or a regex, got {targets!r}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora", False)), targets)


def _check_target_names(path: Path, config: AdapterConfig, layout: LoraLayout) -> None:
    if not isinstance(config.target_modules, tuple):
        return  # a regex or "all-linear": the weights say which modules it changes
    for name in config.target_modules:
        if name in layout.refused:
            raise AdapterError(f"{path}: target module {name!r}: {layout.refused[name]}")
        if name not in layout.modules:
            raise AdapterError(f"{path}: target module {name!r} is not a projection of this model "
                               f"(it takes {', '.join(sorted(layout.modules))})")


def _weights_path(folder: Path) -> Path:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(f"{folder / 'adapter_model.bin'}: only {WEIGHTS_FILE} is read (save the adapter "
                               "with safe_serialization=True)")
        raise AdapterError(f"{path}: missing")
    return path


def _modules(path: Path, keys: list[str], layout: LoraLayout) -> dict[tuple[int, str], dict[str, str]]:
    """(layer, module name) -> {"A": key, "B": key}, every key accounted for."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A or B of a decoder layer's projection "
                               "(embeddings, the LM head and modules_to_save are not served)")
        layer, name, which = int(match.group(1)), match.group(3), match.group(4)
        if name in layout.refused:
            raise AdapterError(f"{path}: module layers.{layer}.{match.group(2)}{name}: {layout.refused[name]}")
        if name not in layout.modules:
            raise AdapterError(f"{path}: module layers.{layer}.{match.group(2)}{name} is not a projection of this "
                               f"model (it takes {', '.join(sorted(layout.modules))})")
        if layer >= layout.num_layers:
            raise AdapterError(f"{path}: module layers.{layer}.{match.group(2)}{name}: the model has "
                               f"{layout.num_layers} layers")
        entry = found.setdefault((layer, name), {})
        if which in entry:
            raise AdapterError(f"{path}: module layers.{layer}.{name} has two lora_{which} tensors")
        entry[which] = key
    for (layer, name), entry in found.items():
        if len(entry) != 2:
            missing = "B" if "A" in entry else "A"
            raise AdapterError(f"{path}: module layers.{layer}.{name} has no lora_{missing}")
    if not found:
        raise AdapterError(f"{path}: holds no LoRA tensors")
    return found


def _check_shape(path: Path, layer: int, name: str, which: str, shape: list[int], expected: tuple[int, int]) -> None:
    if tuple(shape) != expected:
        raise AdapterError(f"{path}: module layers.{layer}.{name}: lora_{which} is {list(shape)}, this model needs "
                           f"{list(expected)}")


def inspect_adapter(folder: str | Path, layout: LoraLayout, max_rank: int) -> AdapterConfig:
    """Check an adapter against the model without reading its weights (their shapes come from the
    safetensors header): AdapterError naming the file and module, else its config."""
    from safetensors import safe_open

    folder = Path(folder)
    config = read_config(folder, max_rank)
    _check_target_names(folder / CONFIG_FILE, config, layout)
    path = _weights_path(folder)
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            modules = _modules(path, keys, layout)
            for (layer, name), entry in modules.items():
                n_in, n_out = layout.module_shape(name)
                _check_shape(path, layer, name, "A", f.get_slice(entry["A"]).get_shape(), (config.rank, n_in))
                _check_shape(path, layer, name, "B", f.get_slice(entry["B"]).get_shape(), (n_out, config.rank))
    except AdapterError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from None
    return config


def load_adapter(folder: str | Path, layout: LoraLayout, max_rank: int, dtype: torch.dtype,
                 pin_memory: bool = False) -> AdapterWeights:
    """The adapter's weights in our layout (inspect_adapter's checks first)."""
    from safetensors import safe_open

    folder = Path(folder)
    config = inspect_adapter(folder, layout, max_rank)
    path = _weights_path(folder)
    r, L = config.rank, layout.num_layers
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    slices: dict[str, set[int]] = {}
    with safe_open(str(path), framework="pt") as f:
        for (layer, name), entry in sorted(_modules(path, list(f.keys()), layout).items()):
            target = layout.modules[name]
            proj = layout.projections[target.kind]
            if target.kind not in a:
                a[target.kind] = torch.zeros(L, len(proj.slice_sizes), r, proj.in_features, dtype=dtype)
                b[target.kind] = torch.zeros(L, proj.out_features, r, dtype=dtype)
                slices[target.kind] = set()
            lora_a, lora_b = f.get_tensor(entry["A"]).to(dtype), f.get_tensor(entry["B"]).to(dtype)
            row = 0
            for j in target.slices:  # a fused module: its one A is each slice's
                start, size = proj.slice_starts[j], proj.slice_sizes[j]
                a[target.kind][layer, j] = lora_a
                b[target.kind][layer, start:start + size] = lora_b[row:row + size]
                row += size
            slices[target.kind].update(target.slices)
    for kind, order in layout.row_orders.items():
        if kind in b:
            b[kind] = b[kind].index_select(1, order).contiguous()
    if pin_memory:
        a = {k: t.pin_memory() for k, t in a.items()}
        b = {k: t.pin_memory() for k, t in b.items()}
    ordered = [k for k in KINDS if k in a]
    return AdapterWeights(r, config.scaling, {k: a[k] for k in ordered}, {k: b[k] for k in ordered},
                          {k: tuple(sorted(slices[k])) for k in ordered})
