"""The host side of a launched decode round: the page-locked buffers its inputs are staged in and
its tokens are copied back to (two alternate, engine/runner/cuda_graphs.py), and the handle the
engine holds until it collects the round."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphserve.engine.sched.scheduler import DecodeRound
from graphserve.engine.structured.mask_feed import FeedJob

# static buffers staged from the host each round
STAGED = ("input_ids", "input_rows", "step_positions", "step_slots", "step_context_lens", "block_tables",
          "temperature", "top_k", "top_p", "min_p", "seeds", "output_pos", "mask_rows", "lora_slots")
PER_STEP = ("step_positions", "step_slots", "step_context_lens")  # [K, n]; the others are [n] or [n, W]


def group_buffer_name(name: str, group: int) -> str:
    """The name of KV cache group `group`'s static buffer `name` (slots, block tables: one per group), in the
    decode graphs' and the prefill graphs' buffers: `name` for group 0, then name<g>."""
    return name if group == 0 else f"{name}{group}"


class HostSlot:
    """Host memory of one launched round, page-locked on CUDA: its staged inputs and its
    tokens copied back. Two slots alternate, so a round's host memory is not rewritten
    while the device may still read (inputs) or write (tokens) it."""

    def __init__(self, device_buffers: dict[str, torch.Tensor], out_tokens: torch.Tensor,
                 out_logprobs: torch.Tensor, pin: bool):
        """device_buffers: the static buffer of each name staged (STAGED, and a further KV cache
        group's), whose size and dtype each host buffer takes."""
        self.inputs = {name: torch.empty(buf.numel(), dtype=buf.dtype, pin_memory=pin)
                       for name, buf in device_buffers.items()}
        self.tokens = torch.zeros(out_tokens.shape, dtype=out_tokens.dtype, pin_memory=pin)
        self.logprobs = torch.zeros(out_logprobs.shape, dtype=out_logprobs.dtype, pin_memory=pin)
        self.event: torch.cuda.Event | None = None  # recorded after the last copy of the slot's last round
        self.launches = 0  # rounds that used this slot: a handle is valid while its own is the last

    def view(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous view of the front of the buffer for `name` (a direct DMA source)."""
        return self.inputs[name][:math.prod(shape)].view(shape)

    def stage(self, name: str, src: torch.Tensor) -> torch.Tensor:
        view = self.view(name, tuple(src.shape))
        view.copy_(src)
        return view


@dataclass
class RoundHandle:
    """A launched round: where its tokens land on the host and the event that says they have."""

    rnd: DecodeRound
    bucket: int
    slot: HostSlot
    launch_index: int  # slot.launches when this round took the slot
    event: torch.cuda.Event | None  # None on CPU, where the round ran inside launch()
    job: FeedJob | None = None  # its grammar rows' masks, being served
    number: int = 0  # the engine's count of rounds launched, this one included
