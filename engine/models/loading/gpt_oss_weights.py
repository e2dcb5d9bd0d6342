"""Where a gpt-oss checkpoint's expert tensors go in moe/gpt_oss.GptOssMoE.

A layer's experts are stacked in the checkpoint, in transformers' GptOssExperts layout:
`mlp.experts.gate_up_proj` [E, H, 2I] (bf16; gate and up outputs alternate: output 2j is gate j, 2j + 1
up j), `down_proj` [E, I, H], `gate_up_proj_bias` [E, 2I] (alternating too), `down_proj_bias` [E, H]; an
MXFP4 checkpoint (quant_method mxfp4, as gpt-oss is released) holds `gate_up_proj_blocks`
[E, 2I, H / 32, 16] and `gate_up_proj_scales` [E, 2I, H / 32] (output rows, alternating) and
`down_proj_blocks` [E, H, I / 32, 16], `down_proj_scales` [E, H, I / 32] instead of the weights.
Ours: weights [E, out, in], gate_up's rows the gate's then the up's (the layout kernels/moe.py's grouped
GEMM takes), MXFP4 blocks as [E, out, in / 2] bytes: the same bytes, rows reordered.

Under tensor parallelism a rank holds each expert's intermediate columns [a, b) (expert_slice): gate_up's
outputs [2a, 2b) (gate and up alternate, so they are one span), down's inputs [a, b), for MXFP4 its groups
[a / 32, b / 32) (sharding.check_tensor_parallel refuses a split off the groups' boundaries).
"""

from __future__ import annotations

import re

import torch

from graphserve.engine.errors import ModelFilesError
from graphserve.kernels.mxfp4 import GROUP

_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_OURS = {"gate_up_proj": "gate_up", "down_proj": "down"}
_SUFFIX = {None: "_proj", "_bias": "_bias", "_blocks": "_blocks", "_scales": "_scales"}


def expert_target(name: str) -> str | None:
    """Our parameter for a checkpoint's expert tensor (e.g. "layers.3.mlp.gate_up_blocks"), or None if
    `name` is not one."""
    match = _EXPERTS.match(name)
    if match is None:
        return None
    layer, proj, kind = match.groups()
    return f"layers.{layer}.mlp.{_OURS[proj]}{_SUFFIX[kind]}"


def expert_slice(name: str, inter: tuple[int, int]) -> tuple[tuple[int, int], int] | None:
    """([start, end), dim) of the checkpoint expert tensor `name` (expert_target is not None) that holds each
    expert's intermediate columns inter = [a, b), or None for down_proj_bias (an output's: no such columns)."""
    proj, kind = _EXPERTS.match(name).groups()[1:]
    a, b = inter
    if proj == "gate_up_proj":  # outputs: the last dim of the weight [E, H, 2I], else dim 1 ([E, 2I, ...])
        return (2 * a, 2 * b), (2 if kind is None else 1)
    if kind == "_bias":
        return None
    if kind is None:  # [E, I, H]
        return (a, b), 1
    assert a % GROUP == 0 and b % GROUP == 0, (name, inter)  # blocks [E, H, I / 32, 16], scales [E, H, I / 32]
    return (a // GROUP, b // GROUP), 2


def _gate_then_up(rows: int, device: torch.device) -> torch.Tensor:
    """The order of 2I alternating gate / up rows that puts the gate's first, then the up's."""
    return torch.cat([torch.arange(0, rows, 2, device=device), torch.arange(1, rows, 2, device=device)])


def to_our_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A checkpoint expert tensor `name` (expert_target is not None) in our layout."""
    proj, kind = _EXPERTS.match(name).groups()[1:]
    if kind is None:  # weights [E, in, out] -> [E, out, in]
        tensor = tensor.transpose(1, 2)
    elif kind == "_blocks":  # [E, out, in / 32, 16] -> [E, out, in / 2]
        tensor = tensor.reshape(*tensor.shape[:2], -1)
    if proj == "gate_up_proj":
        tensor = tensor.index_select(1, _gate_then_up(tensor.shape[1], tensor.device))
    return tensor


def copy_expert_tensor(param: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    """The checkpoint tensor `name` into our parameter, or ModelFilesError for a shape that does not fit."""
    ours = to_our_layout(name, tensor)
    if ours.shape != param.shape or (ours.dtype == torch.uint8) != (param.dtype == torch.uint8):
        raise ModelFilesError(f"{name} has shape {tuple(tensor.shape)} ({tensor.dtype}), which does not fit the "
                              f"model's {tuple(param.shape)} ({param.dtype}) in its layout")
    param.copy_(ours)
