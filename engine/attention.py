"""Attention over the paged KV cache. `AttentionMetadata` is built by the runner and
passed explicitly through the model. Two backends share one interface: torch (CPU
reference, gather + scaled dot product attention) and Triton (CUDA kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.layers import apply_rotary


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


class TorchAttention:
    """CPU backend: writes K/V with index_copy, gathers each sequence's blocks, runs SDPA."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Rotate q and k, write k and v into the cache, attend. Returns [T, Hq, D]."""
        q, k = apply_rotary(q, k, positions, cos_sin)
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

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        blocks = meta.block_tables.flatten()
        gathered = (batch, -1, *k_cache.shape[2:])
        keys = k_cache.index_select(0, blocks).view(gathered).transpose(1, 2)  # [B, Hkv, L, D]
        values = v_cache.index_select(0, blocks).view(gathered).transpose(1, 2)
        valid = torch.arange(keys.shape[2], device=q.device)[None, :] < meta.context_lens[:, None]
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=valid[:, None, None, :],
                                             scale=scale, enable_gqa=True)
        return out.view(batch, num_heads, head_dim)


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
