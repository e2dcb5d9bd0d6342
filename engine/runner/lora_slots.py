"""LoraSlots: the device memory of LoRA adapters and which adapter each slot holds.

Per projection kind one stacked A [slots, layers, slices, R, in] and B [slots, layers, out, R] (R the
maximum rank, rounded up for the kernels); each layer's projection gets its views (Linear.lora), so a
step's rows pick adapters by slot index alone. Before a step runs, its sequences' adapters are put in
slots (activate): one held already stays, else a free slot or the least recently used one that no
running request needs is overwritten from the host cache. The scheduler admits at most max_loras
adapters among the running requests, so a slot is always there. The copies run on the device's stream,
after any round still in flight, which may read the slot but only for rows that have ended."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from graphserve.engine.lora.adapter import AdapterWeights
from graphserve.engine.lora.apply import LoraWeights, SlotTable
from graphserve.engine.lora.host_cache import AdapterCache
from graphserve.engine.lora.layout import LoraLayout
from graphserve.engine.models.llama import LlamaModel
from graphserve.engine.request import Sequence
from graphserve.kernels.lora import block_rank

_MODULES = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"), "gate_up": ("mlp", "gate_up_proj"),
            "down": ("mlp", "down_proj")}


class LoraSlots:
    def __init__(self, model: LlamaModel, layout: LoraLayout, cache: AdapterCache, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.cache = cache
        self.num_slots = max_loras
        self.device = device
        rank_dim = block_rank(max_rank)
        L, S = layout.num_layers, max_loras
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for kind, proj in layout.projections.items():
            ns = len(proj.slice_sizes)
            self.a[kind] = torch.zeros(S, L, ns, rank_dim, proj.in_features, dtype=dtype, device=device)
            self.b[kind] = torch.zeros(S, L, proj.out_features, rank_dim, dtype=dtype, device=device)
        self.table = SlotTable(
            ranks={k: torch.zeros(S, len(p.slice_sizes), dtype=torch.int32, device=device)
                   for k, p in layout.projections.items()},
            scales=torch.zeros(S, dtype=torch.float32, device=device),
            ranks_host={k: [[0] * len(p.slice_sizes) for _ in range(S)] for k, p in layout.projections.items()},
            scales_host=[0.0] * S)
        for i, layer in enumerate(model.layers):
            for kind, proj in layout.projections.items():
                parent, name = _MODULES[kind]
                getattr(getattr(layer, parent), name).lora = LoraWeights(kind, self.a[kind][:, i], self.b[kind][:, i],
                                                                         proj.slice_sizes, self.table)
        self._held: OrderedDict[int, int] = OrderedDict()  # adapter id -> its slot, least recently used first
        self._free = list(range(S))

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def held(self) -> dict[int, int]:
        """Adapter id -> slot, of the adapters on the device now."""
        return dict(self._held)

    def activate(self, seqs: Iterable[Sequence], running: Iterable[Sequence]) -> None:
        """Put the adapters of `seqs` in slots (from the host cache, which holds every live request's) and
        set each sequence's lora_slot; an evicted slot is one no sequence of `running` or `seqs` uses."""
        seqs = list(seqs)
        wanted = {s.lora.lora_id for s in seqs if s.lora is not None}
        for lora_id in wanted:
            if lora_id in self._held:
                self._held.move_to_end(lora_id)
                continue
            self._place(lora_id, wanted | {s.lora.lora_id for s in running if s.lora is not None})
        for seq in seqs:
            seq.lora_slot = self._held[seq.lora.lora_id] if seq.lora is not None else -1

    def _place(self, lora_id: int, in_use: set[int]) -> None:
        if self._free:
            slot = self._free.pop(0)
        else:
            victim = next((i for i in self._held if i not in in_use), None)
            if victim is None:
                raise RuntimeError(f"all {self.num_slots} LoRA slots hold adapters running requests use "
                                   "(the scheduler admits at most max_loras)")
            slot = self._held.pop(victim)
        self._write(slot, self.cache.get(lora_id))
        self._held[lora_id] = slot

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        r, table = weights.rank, self.table
        non_blocking = self.device.type == "cuda"
        for kind, proj in self.layout.projections.items():
            covered = weights.slices.get(kind, ())
            ranks = [r if j in covered else 0 for j in range(len(proj.slice_sizes))]
            if covered:
                self.a[kind][slot, ..., :r, :].copy_(weights.a[kind], non_blocking=non_blocking)
                self.b[kind][slot, ..., :r].copy_(weights.b[kind], non_blocking=non_blocking)
            table.ranks_host[kind][slot] = ranks
            table.ranks[kind][slot].copy_(torch.tensor(ranks, dtype=torch.int32), non_blocking=False)
        table.scales_host[slot] = weights.scaling
        table.scales[slot].fill_(weights.scaling)
