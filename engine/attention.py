"""Attention over the paged KV cache. `AttentionMetadata` is built by the runner and
passed explicitly through the model. Two backends share one interface: torch (CPU
reference, gather + scaled dot product attention) and Triton (CUDA kernels)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.cpu_attention import paged_decode_attention
from engine.models.layers import apply_rotary, rotary_tables


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to.

    Prefill: a packed batch of query chunks; sequence b's queries are
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] at the last positions of its context_lens[b] tokens.
    Decode: one query token per sequence.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64; where each new token's K/V is written
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32: KV tokens per sequence, this step's included
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32, prefill only
    max_seqlen_q: int = 1
    # host copies the CPU prefill path loops over (known when the batch is built; no sync)
    query_lens_host: list[int] | None = None
    context_lens_host: list[int] | None = None
    # what a backend derives from this step's metadata once and reuses in every layer
    # (the torch backend: rotary tables, the flat block list, the decode mask)
    derived: dict = field(default_factory=dict, repr=False, compare=False)


class TorchAttention:
    """CPU backend: writes K/V with index_copy, gathers each sequence's blocks, runs SDPA.

    What depends only on the step (rotary tables of the positions, the flat block list, the
    additive mask of the decode batch) is made by the first layer and kept in meta.derived."""

    def __init__(self, block_size: int, use_kernel: bool = True):
        self.block_size = block_size
        self.use_kernel = use_kernel  # decode through engine/cpu_attention.py where it applies

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Rotate q and k, write k and v into the cache, attend. Returns [T, Hq, D]."""
        rope = meta.derived.get("rope")
        if rope is None or rope[0] is not positions:  # keyed by the positions tensor itself (held here)
            rope = meta.derived["rope"] = (positions, rotary_tables(positions, cos_sin, q.dtype))
        q, k = apply_rotary(q, k, positions, cos_sin, rope[1])
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return self._prefill(q, k_cache, v_cache, meta, scale)
        return self._decode(q, k_cache, v_cache, meta, scale)

    def attend_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
        """Decode attention of rotated q over a cache that already holds this step's K/V."""
        return self._decode(q, k_cache, v_cache, meta, scale)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
        num_blocks = -(-num_tokens // self.block_size)
        return cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:num_tokens]

    def _prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for b, (q_len, ctx_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            qb = q[start:start + q_len].transpose(0, 1)  # [Hq, n, D]
            kb = self._gather(k_cache, meta.block_tables[b], ctx_len).transpose(0, 1)
            vb = self._gather(v_cache, meta.block_tables[b], ctx_len).transpose(0, 1)
            if q_len == ctx_len:
                mask, causal = None, True
            else:  # a chunk after cached tokens: query i sits at position ctx_len - q_len + i
                qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
                mask = torch.arange(ctx_len, device=q.device)[None, :] <= qpos[:, None]
                causal = False
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=causal, scale=scale,
                                                enable_gqa=True)
            out[start:start + q_len] = ob.transpose(0, 1)
            start += q_len
        return out

    # Decode rows are split into groups of similar length, each padded to its own longest row,
    # when that saves more gathered-and-attended blocks than a group's fixed cost (in blocks of
    # one row): a group adds about five small ops per layer, ~40 us, where one row's block costs
    # ~2.5 us to gather and attend (the embedded model, 2 cores).
    GROUP_COST_BLOCKS = 16

    def _row_groups(self, lens: list[int]) -> list[list[int]]:
        """Rows (batch indices) grouped by length: the split of the rows sorted by length that
        minimises sum(rows x blocks of the longest) + GROUP_COST_BLOCKS per group."""
        order = sorted(range(len(lens)), key=lens.__getitem__)
        blocks = [-(-lens[i] // self.block_size) for i in order]
        n = len(order)
        best = [0] + [None] * n  # best[j]: cost of the first j sorted rows; cut[j]: where its last group starts
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            for i in range(j):
                cost = best[i] + (j - i) * blocks[j - 1] + self.GROUP_COST_BLOCKS
                if best[j] is None or cost < best[j]:
                    best[j], cut[j] = cost, i
        groups, j = [], n
        while j > 0:
            groups.append(sorted(order[cut[j]:j]))
            j = cut[j]
        return groups[::-1]

    def _decode_inputs(self, meta: AttentionMetadata, dtype: torch.dtype) -> list[tuple]:
        """Per group of rows: (rows as an index or None for all, their blocks flat, additive mask
        [n, 1, 1, width]: 0 within the row's context, -inf past it). Made once per step."""
        made = meta.derived.get("decode")
        if made is not None:
            return made
        tables, lens = meta.block_tables, meta.context_lens
        host_lens = lens.tolist()
        groups = self._row_groups(host_lens) if len(host_lens) > 1 else [list(range(len(host_lens)))]
        made = []
        for rows in groups:
            width = -(-max(host_lens[i] for i in rows) // self.block_size)
            if len(groups) == 1:
                index, t, ln = None, tables[:, :width], lens
            else:
                index = torch.tensor(rows, dtype=torch.int64, device=lens.device)
                t, ln = tables.index_select(0, index)[:, :width], lens.index_select(0, index)
            past = torch.arange(width * self.block_size, device=lens.device)[None, :] >= ln[:, None]
            mask = torch.zeros(past.shape, dtype=dtype, device=lens.device).masked_fill_(past, float("-inf"))
            made.append((index, t.flatten(), mask[:, None, None, :]))
        meta.derived["decode"] = made
        return made

    def _attend(self, q, k_cache, v_cache, blocks, mask, scale):
        batch, num_heads, head_dim = q.shape
        gathered = (batch, -1, *k_cache.shape[2:])
        keys = k_cache.index_select(0, blocks).view(gathered).transpose(1, 2)  # [B, Hkv, L, D]
        values = v_cache.index_select(0, blocks).view(gathered).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
        return out.view(batch, num_heads, head_dim)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.use_kernel:
            out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
            if out is not None:
                return out
        groups = self._decode_inputs(meta, q.dtype)
        if len(groups) == 1:
            return self._attend(q, k_cache, v_cache, groups[0][1], groups[0][2], scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for index, blocks, mask in groups:
            out.index_copy_(0, index, self._attend(q.index_select(0, index), k_cache, v_cache, blocks, mask, scale))
        return out


class TritonAttention:
    """CUDA backend: fused rotary + KV store, paged prefill and paged (split-K) decode kernels."""

    def __init__(self, block_size: int):
        from kernels import (
            paged_decode_attention,
            paged_prefill_attention,
            rope_and_store_kv,
        )

        self.block_size = block_size
        self._rope_store, self._prefill, self._decode = rope_and_store_kv, paged_prefill_attention, paged_decode_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        q = self._rope_store(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                 meta.max_seqlen_q, scale)
        return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)

    def attend_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
        """Decode attention of rotated q over a cache that already holds this step's K/V."""
        return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)


def make_attention_backend(device: torch.device, block_size: int) -> TorchAttention | TritonAttention:
    return TritonAttention(block_size) if device.type == "cuda" else TorchAttention(block_size)
