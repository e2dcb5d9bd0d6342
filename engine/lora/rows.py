"""LoraRows: which adapter slot each row of a step uses, passed to the model with the step's other
metadata (AttentionMetadata.lora), never through a global. A decode step's slots are a static input of
its CUDA graph, so any mix of adapters replays the same graph."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphserve.kernels.lora import segment_tiles


@dataclass(frozen=True)
class LoraRows:
    slots: torch.Tensor  # [T] int32 on the model's device: each row's slot, -1: no adapter
    # prefill (CUDA): the segments' tile map for kernels/lora.py; None: one program per row (decode)
    tiles: torch.Tensor | None = None
    # whether any row may use an adapter: known on the host (CPU, a prefill); a CUDA graph's rows: True
    applies: bool = True
    # host: (slot, first row, end row) runs of rows of one adapter (the CPU path), None: read from slots
    segments: tuple[tuple[int, int, int], ...] | None = None

    @classmethod
    def for_rows(cls, slots: torch.Tensor) -> "LoraRows":
        """A decode step's rows. On CPU the slots are host memory: which rows use an adapter is known."""
        if slots.is_cuda:
            return cls(slots)
        return cls(slots, applies=bool((slots >= 0).any()))

    @classmethod
    def for_segments(cls, seq_slots: np.ndarray, query_lens: np.ndarray, device: torch.device,
                     keep_base: bool = False) -> "LoraRows | None":
        """A packed prefill's rows: sequence i's query_lens[i] rows use slot seq_slots[i]. None when no
        sequence uses an adapter (unless keep_base: the warm-up's kernels run all the same)."""
        if not keep_base and not (seq_slots >= 0).any():
            return None
        ends = np.cumsum(query_lens)
        segments = tuple((int(s), int(e - n), int(e)) for s, n, e in zip(seq_slots, query_lens, ends))
        slots = torch.from_numpy(np.repeat(seq_slots.astype(np.int32), query_lens)).to(device)
        tiles = None
        if device.type == "cuda":
            tiles = torch.from_numpy(segment_tiles(list(segments), min_tiles=1)).to(device)
        return cls(slots, tiles, True, segments)

    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """(slot, first row, end row) runs of rows with one adapter (host; the CPU path)."""
        if self.segments is not None:
            return self.segments
        values = self.slots.tolist()
        runs, start = [], 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[start]:
                runs.append((values[start], start, i))
                start = i
        return tuple(runs)
