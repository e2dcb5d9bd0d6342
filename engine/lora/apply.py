"""The product an adapter adds to one projection, y += scale * B @ (A @ x) for each row with an adapter:
the Triton kernels of kernels/lora.py on CUDA; on CPU (float32) the C kernel of engine/cpu/lora.py, which
the C decode stack calls too, at the adapter's own rank, in the order PEFT computes it (lora_B(lora_A(x))
* scaling), each row's sums in one fixed order: a row's numbers never depend on its batch mates or on how
its prompt was chunked (a matrix product of several rows, torch's, rounds a row by how many rows share
the call). Elsewhere on CPU (another dtype, no C compiler) torch runs each row alone, as peft runs each
decode step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphserve.engine.cpu import lora as cpu_lora
from graphserve.engine.lora.rows import LoraRows


@dataclass
class SlotTable:
    """Per device slot, what the adapter in it is: its rank on each slice of each projection kind (0:
    it leaves the slice alone; nothing loaded: all 0) and its scaling, on the device (the kernels; on
    CPU the C kernel reads these tensors) and as host lists (the CPU torch fallback).
    engine/runner/lora_slots.py writes it in place."""

    ranks: dict[str, torch.Tensor]  # kind -> [S, slices] int32
    scales: torch.Tensor  # [S] float32
    ranks_host: dict[str, list[list[int]]]
    scales_host: list[float]


@dataclass
class LoraWeights:
    """One projection's adapter slots in one layer: views of the stacked slots."""

    kind: str
    a: torch.Tensor  # [S, slices, R, in]
    b: torch.Tensor  # [S, out, R]
    slice_sizes: tuple[int, ...]
    table: SlotTable
    # the CPU kernel's view of these slots (engine/cpu/lora.py), made on first use; False: it does not take them
    _cpu: cpu_lora.LoraProjection | bool | None = field(default=None, repr=False, compare=False)

    def cpu_projection(self) -> cpu_lora.LoraProjection | None:
        """The C kernel's view of these slots (the per-layer path's and the decode stack's), or None where
        it does not take them (not float32, no C compiler)."""
        if self._cpu is None:
            self._cpu = cpu_lora.projection(self.a, self.b, self.table.ranks[self.kind], self.table.scales,
                                            self.slice_sizes) or False
        return self._cpu or None


def add_lora(y: torch.Tensor, x: torch.Tensor, weights: LoraWeights, rows: LoraRows,
             norm: tuple[torch.Tensor, float] | None = None, silu_mul: bool = False) -> torch.Tensor:
    """y [T, out] (the base projection of x [T, in]) plus each row's adapter product; y changes in place.
    On CUDA only (the kernels fuse them): norm (weight, eps), x goes through that RMSNorm first; silu_mul,
    the result is silu(gate) * up of the sums (a new tensor)."""
    table = weights.table
    if y.is_cuda:
        from graphserve.kernels.lora import lora_add

        x = x if x.stride(-1) == 1 else x.contiguous()
        return lora_add(y, x, weights.a, weights.b, table.ranks[weights.kind], table.scales, weights.slice_sizes,
                        slots=None if rows.tiles is not None else rows.slots, tiles=rows.tiles, norm=norm,
                        silu_mul=silu_mul)
    if norm is not None or silu_mul:
        raise ValueError("the CPU path takes the normed input and applies the SiLU itself")
    projection = weights.cpu_projection()
    if projection is not None and x.dtype == y.dtype == torch.float32 and x.stride(-1) == 1 and y.stride(-1) == 1:
        return cpu_lora.lora_add(y, x, projection, rows.slots)
    ranks = table.ranks_host[weights.kind]
    for slot, first, end in rows.runs():
        if slot < 0:
            continue
        xs, start = x[first:end], 0
        for j, size in enumerate(weights.slice_sizes):
            rank = ranks[slot][j]
            if rank:
                u = rowwise_linear(xs, weights.a[slot, j, :rank])
                delta = rowwise_linear(u, weights.b[slot, start:start + size, :rank])
                y[first:end, start:start + size] += delta * table.scales_host[slot]
            start += size
    return y


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ weight.T, every row as F.linear computes a one-row x, bit for bit, in one batched call."""
    rows = x.shape[0]
    return torch.bmm(x.unsqueeze(1), weight.t().unsqueeze(0).expand(rows, -1, -1)).squeeze(1)
