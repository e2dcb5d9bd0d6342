"""LoraLayout: the base model's projections an adapter may change, and where each PEFT module lands.

Our decoder fuses projections (engine/models/llama.py): q, k and v are slices of one qkv output, gate
and up of one gate_up output. An adapter's module (q_proj, or Phi-3's fused qkv_proj) adds its product
to the slices it covers; a fused module's one A is that of each of its slices."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KINDS = ("qkv", "o", "gate_up", "down")  # our projections, in each layer


@dataclass(frozen=True)
class Projection:
    """One of our projections as adapters see it: its input width and its output's slices."""

    in_features: int
    slice_sizes: tuple[int, ...]  # q, k, v / gate, up / the whole output

    @property
    def out_features(self) -> int:
        return sum(self.slice_sizes)

    @property
    def slice_starts(self) -> tuple[int, ...]:
        starts, at = [], 0
        for size in self.slice_sizes:
            starts.append(at)
            at += size
        return tuple(starts)


@dataclass(frozen=True)
class ModuleTarget:
    """Where a PEFT module's product goes: projection `kind`, the slices it covers (one A for all of them,
    B's rows over them in order)."""

    kind: str
    slices: tuple[int, ...]


@dataclass(frozen=True)
class LoraLayout:
    num_layers: int
    projections: dict[str, Projection]  # kind -> shape
    modules: dict[str, ModuleTarget]  # PEFT module name (q_proj, qkv_proj, ...) -> target
    refused: dict[str, str] = field(default_factory=dict)  # module name -> why this model takes no adapter there
    # kind -> our order of its output rows (Phi-3's partial rotary reorders q and k heads' dims:
    # engine/models/loading/after_load.py),
    # applied to an adapter's B as to the base weight: row j holds the checkpoint's row order[j]
    row_orders: dict[str, torch.Tensor] = field(default_factory=dict)

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a PEFT module: its A is [r, in], its B [out, r]."""
        target = self.modules[module]
        proj = self.projections[target.kind]
        return proj.in_features, sum(proj.slice_sizes[j] for j in target.slices)


def dense_layout(num_layers: int, hidden: int, q_size: int, kv_size: int, intermediate: int, moe: bool = False,
                 qkv_row_order: torch.Tensor | None = None) -> LoraLayout:
    """The layout of our Llama-family decoder (engine/models/llama.py). moe: the MLP is routed experts,
    which take no adapters (attention's projections do)."""
    projections = {"qkv": Projection(hidden, (q_size, kv_size, kv_size)), "o": Projection(q_size, (hidden,))}
    modules = {"q_proj": ModuleTarget("qkv", (0,)), "k_proj": ModuleTarget("qkv", (1,)),
               "v_proj": ModuleTarget("qkv", (2,)), "qkv_proj": ModuleTarget("qkv", (0, 1, 2)),
               "o_proj": ModuleTarget("o", (0,))}
    refused = {}
    mlp_modules = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
    if moe:
        why = "this is a mixture-of-experts model: its experts take no LoRA adapters (attention's projections do)"
        refused = dict.fromkeys((*mlp_modules, "w1", "w2", "w3"), why)
    else:
        projections["gate_up"] = Projection(hidden, (intermediate, intermediate))
        projections["down"] = Projection(intermediate, (hidden,))
        modules.update({"gate_proj": ModuleTarget("gate_up", (0,)), "up_proj": ModuleTarget("gate_up", (1,)),
                        "gate_up_proj": ModuleTarget("gate_up", (0, 1)), "down_proj": ModuleTarget("down", (0,))})
    row_orders = {"qkv": qkv_row_order} if qkv_row_order is not None else {}
    return LoraLayout(num_layers, projections, modules, refused, row_orders)
