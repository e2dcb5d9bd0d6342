"""Where a Hugging Face checkpoint's mixture-of-experts tensors go in moe.SparseMoE.

Checkpoints (on the hub, and as transformers' save_pretrained writes them) hold one tensor per
expert and projection: Qwen3-MoE `mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`, Mixtral
`block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (w1 the gate, w3 the up, w2 the down
projection), and the router `mlp.gate.weight` / `block_sparse_moe.gate.weight`. The loader stacks
them at load into gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and
down_proj [E, H, I]. A compressed-tensors FP8 checkpoint (llm-compressor) holds each expert
projection's weight in e4m3 beside its `weight_scale` ([out, 1] per channel, or one per tensor):
the scales are stacked likewise into gate_up_scale [E, 2I] and down_scale [E, H]."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from graphserve.engine.errors import ModelFilesError

GATE_UP, DOWN = "mlp.gate_up_proj", "mlp.down_proj"
SCALES = {GATE_UP: "mlp.gate_up_scale", DOWN: "mlp.down_scale"}  # a stacked weight's FP8 scales
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
# projection -> (stacked parameter, half of gate_up_proj's rows: 0 gate, 1 up; None: the whole expert)
_PROJECTIONS = {
    "gate_proj": (GATE_UP, 0), "w1": (GATE_UP, 0),
    "up_proj": (GATE_UP, 1), "w3": (GATE_UP, 1),
    "down_proj": (DOWN, None), "w2": (DOWN, None),
}
ROUTER_NAMES = {"mlp.gate": "mlp.router", "block_sparse_moe.gate": "mlp.router"}  # HF module -> ours


@dataclass(frozen=True)
class ExpertSlot:
    param: str  # GATE_UP or DOWN, within the layer
    expert: int
    half: int | None  # 0 gate / 1 up rows of GATE_UP; None for DOWN


def expert_slot(module: str) -> ExpertSlot | None:
    """The slot of an HF layer module such as "mlp.experts.3.up_proj", or None if not an expert's."""
    match = _EXPERT.match(module)
    if match is None:
        return None
    param, half = _PROJECTIONS[match.group(2)]
    return ExpertSlot(param, int(match.group(1)), half)


def part_name(target: str, expert: int, half: int | None) -> str:
    """What the loader records as loaded for one expert tensor of the stacked parameter `target`."""
    return f"{target}#expert{expert}" + ("" if half is None else f".{half}")


def copy_expert(stacked: torch.Tensor, slot: ExpertSlot, tensor: torch.Tensor, name: str) -> None:
    """The checkpoint tensor `name` into its rows of the stacked parameter."""
    if slot.expert >= stacked.shape[0]:
        raise ModelFilesError(f"{name}: expert {slot.expert} of a model with {stacked.shape[0]} experts")
    rows = stacked[slot.expert]
    if slot.half is not None:
        inter = rows.shape[0] // 2
        rows = rows[slot.half * inter:(slot.half + 1) * inter]
    if rows.shape != tensor.shape:
        raise ModelFilesError(f"{name} has shape {tuple(tensor.shape)} where {tuple(rows.shape)} was expected")
    rows.copy_(tensor)


def copy_expert_scale(stacked: torch.Tensor, slot: ExpertSlot, tensor: torch.Tensor, rows: tuple[int, int] | None,
                      name: str) -> None:
    """A checkpoint weight_scale ([out, 1], [out], or one for the whole tensor) into its entries of
    the stacked scales [E, N]; rows: the [a, b) of its output rows this rank holds (None: all)."""
    scale = tensor.float().flatten()
    if scale.numel() == 1:
        scale = scale.expand(stacked.shape[1] // (1 if slot.half is None else 2))
    elif rows is not None:
        scale = scale[rows[0]:rows[1]]
    copy_expert(stacked, slot, scale, name)


def complete_stacks(params: dict[str, torch.Tensor], loaded: set[str]) -> set[str]:
    """The stacked expert parameters (weights, FP8 scales) every one of whose experts' tensors is in `loaded`."""
    gate_up_stacks = (GATE_UP, SCALES[GATE_UP])
    complete = set()
    for name, param in params.items():
        if not name.endswith((*gate_up_stacks, DOWN, SCALES[DOWN])):
            continue
        halves = (0, 1) if name.endswith(gate_up_stacks) else (None,)
        if all(part_name(name, e, h) in loaded for e in range(param.shape[0]) for h in halves):
            complete.add(name)
    return complete
