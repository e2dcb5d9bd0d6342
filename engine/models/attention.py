"""Attention over the paged KV cache. `AttentionMetadata` is built by the runner and
passed explicitly through the model. Two backends share one interface: torch (CPU
reference, gather + scaled dot product attention) and Triton (CUDA kernels)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from graphserve.engine.cpu.attention import paged_decode_attention
from graphserve.engine.lora.rows import LoraRows
from graphserve.engine.models.layers import apply_rotary, rms_norm, rotary_tables
from graphserve.kernels.fp8_quant import AmaxedRows


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
    # prefill (CUDA): a tile map [2, N] int32 for the attention kernel, whose grid then does
    # not depend on the batch (kernels/prefill_attention.py; the prefill CUDA graphs)
    attention_tiles: torch.Tensor | None = None
    # which LoRA adapter slot each row uses (engine/lora/rows.py); None: no row uses one
    lora: LoraRows | None = None
    # several KV cache groups (engine/sched/kv_groups.py): each layer's group, and each group's
    # metadata (its slot mapping and block tables; the rest, `derived` included, this one's).
    # Empty: one group, this metadata every layer's
    layer_groups: tuple[int, ...] = ()
    groups: tuple["AttentionMetadata", ...] = field(default=(), repr=False, compare=False)

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """The metadata layer `layer` attends with: its KV cache group's."""
        return self.groups[self.layer_groups[layer]] if self.layer_groups else self

    def with_groups(self, layer_groups: tuple[int, ...],
                    group_tables: list[tuple[torch.Tensor, torch.Tensor]]) -> "AttentionMetadata":
        """This metadata (group 0's) with each further group's (slot mapping, block tables) as
        group_tables[g - 1]; with none, itself."""
        if not group_tables:
            return self
        others = [replace(self, slot_mapping=slots, block_tables=tables, groups=()) for slots, tables in group_tables]
        self.layer_groups = layer_groups
        self.groups = (self, *others)
        for other in others:
            other.derived = self.derived  # one step: what the layers derive is shared (keyed by window)
        return self


def step_rotary_tables(meta: AttentionMetadata, positions: torch.Tensor, cos_sin: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_tables of the step's positions, made once per step and table (Gemma 3 has two), keyed by
    the positions tensor itself (held in meta.derived)."""
    key = ("rope", cos_sin.data_ptr())
    rope = meta.derived.get(key)
    if rope is None or rope[0] is not positions:
        rope = meta.derived[key] = (positions, rotary_tables(positions, cos_sin, dtype))
    return rope[1]


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [q . k * scale (masked), sink] of each head, the sink's share dropped, times v: gpt-oss's
    attention as transformers' eager_attention_forward computes it. q [B, Hq, n, D], k and v [B, Hkv, L, D],
    mask bool (True: attended) or additive, broadcastable to [B, Hq, n, L]; sinks [Hq]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = torch.matmul(q, k.transpose(2, 3)) * scale
    logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    sink = sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


class TorchAttention:
    """CPU backend: writes K/V with index_copy; attention in a small C kernel that reads the
    blocks in place (engine/cpu/attention.py), one query row at a time, for decode and prefill
    rows alike (so a row's numbers do not depend on its step's other rows); where the kernel is
    unavailable, decode gathers the blocks for SDPA, and prefill each sequence's.

    What depends only on the step (rotary tables of the positions, the flat block list and
    additive mask of the decode batch) is made by the first layer and kept in meta.derived."""

    def __init__(self, block_size: int, use_kernel: bool = True):
        self.block_size = block_size
        self.use_kernel = use_kernel  # decode through engine/cpu/attention.py where it applies

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, row_amax: bool = False,
                qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Norm q and k per head (qk_norm: q weight, k weight, eps; Qwen3), rotate them, write k and v
        into the cache, attend. Returns [T, Hq, D] (row_amax: the Triton backend's; never asked for on
        CPU, layers.hands_row_amax). window: the layer's sliding window, each query attends to the
        last `window` positions up to its own (None: all before it). sinks [Hq] (gpt-oss): each head's
        learned logit, one more term of its softmax's denominator (a key no value goes with)."""
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
        q, k = apply_rotary(q, k, positions, cos_sin, step_rotary_tables(meta, positions, cos_sin, q.dtype))
        self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return self._prefill(q, k_cache, v_cache, meta, scale, window, sinks)
        return self._decode(q, k_cache, v_cache, meta, scale, window, sinks)

    def attend_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, row_amax: bool = False, window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of rotated q over a cache that already holds this step's K/V."""
        return self._decode(q, k_cache, v_cache, meta, scale, window, sinks)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
        num_blocks = -(-num_tokens // self.block_size)
        return cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:num_tokens]

    def _prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                 window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Every query row through the decode kernel, as a decode step at its position would run it,
        where the kernel applies: a row's numbers then do not depend on how its prompt was chunked
        or what shares its step (with int8-rounded activations a last-bit difference can change a
        token). Else each sequence's blocks gathered and SDPA."""
        if self.use_kernel:
            tables, lens = self._row_inputs(meta, window)
            real = len(lens)  # the static prefill path pads q past the batch's rows
            out = paged_decode_attention(q[:real], k_cache, v_cache, tables, lens, scale, window=window, sinks=sinks)
            if out is not None:
                return out if real == len(q) else torch.cat([out, q.new_zeros((len(q) - real, *q.shape[1:]))])
        out = torch.empty_like(q)
        start = 0
        for b, (q_len, ctx_len) in enumerate(zip(meta.query_lens_host, meta.context_lens_host)):
            qb = q[start:start + q_len].transpose(0, 1)  # [Hq, n, D]
            kb = self._gather(k_cache, meta.block_tables[b], ctx_len).transpose(0, 1)
            vb = self._gather(v_cache, meta.block_tables[b], ctx_len).transpose(0, 1)
            if q_len == ctx_len and window is None:
                mask, causal = None, True
            else:  # a chunk after cached tokens: query i sits at position ctx_len - q_len + i
                qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
                keys = torch.arange(ctx_len, device=q.device)[None, :]
                mask = keys <= qpos[:, None]
                if window is not None:
                    mask &= keys > qpos[:, None] - window
                causal = False
            if sinks is not None:
                if mask is None:
                    mask = torch.ones(q_len, ctx_len, dtype=torch.bool, device=q.device).tril()
                ob = attention_with_sinks(qb[None], kb[None], vb[None], mask, scale, sinks)
            else:  # 4-D (a batch of one): torch's CPU flash kernel takes it; 3-D runs the slower math path
                ob = F.scaled_dot_product_attention(qb[None], kb[None], vb[None], attn_mask=mask, is_causal=causal,
                                                    scale=scale, enable_gqa=True)
            out[start:start + q_len] = ob[0].transpose(0, 1)
            start += q_len
        return out

    def _row_inputs(self, meta: AttentionMetadata, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query row of a prefill step: its sequence's block table and its context length (its
        position + 1), made once per step and window (each window is a KV cache group of its own tables)."""
        key = ("rows", window)
        made = meta.derived.get(key)
        if made is None:
            seq = torch.repeat_interleave(torch.arange(len(meta.query_lens_host)), torch.tensor(meta.query_lens_host))
            lens = torch.cat([torch.arange(c - n + 1, c + 1, dtype=torch.int32)
                              for n, c in zip(meta.query_lens_host, meta.context_lens_host)])
            made = meta.derived[key] = (meta.block_tables.index_select(0, seq).contiguous(), lens)
        return made

    def _decode_inputs(self, meta: AttentionMetadata, dtype: torch.dtype,
                       window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(every row's blocks, flat; additive mask [B, 1, 1, W * block_size]: 0 within the
        row's context (its last `window` tokens), -inf elsewhere), made once per step and window."""
        key = ("decode", window)
        made = meta.derived.get(key)
        if made is None:
            tables, lens = meta.block_tables, meta.context_lens
            tokens = torch.arange(tables.shape[1] * self.block_size, device=lens.device)[None, :]
            hidden = tokens >= lens[:, None]
            if window is not None:
                hidden |= tokens < lens[:, None] - window
            mask = torch.zeros(hidden.shape, dtype=dtype, device=lens.device).masked_fill_(hidden, float("-inf"))
            made = meta.derived[key] = (tables.flatten(), mask[:, None, None, :])
        return made

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The C kernel where it applies (engine/cpu/attention.py), else every row's blocks
        gathered into [B, Hkv, W * block_size, D] and SDPA with the padding (and what lies before
        the window) masked."""
        if self.use_kernel:
            out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                         window=window, sinks=sinks)
            if out is not None:
                return out
        batch, num_heads, head_dim = q.shape
        blocks, mask = self._decode_inputs(meta, q.dtype, window)
        gathered = (batch, -1, *k_cache.shape[2:])
        keys = k_cache.index_select(0, blocks).view(gathered).transpose(1, 2)  # [B, Hkv, L, D]
        values = v_cache.index_select(0, blocks).view(gathered).transpose(1, 2)
        if sinks is not None:
            out = attention_with_sinks(q[:, :, None, :], keys, values, mask, scale, sinks)
        else:
            out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask, scale=scale,
                                                 enable_gqa=True)
        return out.view(batch, num_heads, head_dim)


class TritonAttention:
    """CUDA backend: fused rotary + KV store, paged prefill and paged (split-K) decode kernels."""

    def __init__(self, block_size: int):
        from graphserve.kernels.decode_attention import paged_decode_attention
        from graphserve.kernels.prefill_attention import paged_prefill_attention
        from graphserve.kernels.rope_kv_store import rope_and_store_kv

        self.block_size = block_size
        self._rope_store, self._prefill, self._decode = rope_and_store_kv, paged_prefill_attention, paged_decode_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, row_amax: bool = False,
                qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor | AmaxedRows:
        """As TorchAttention.forward, the norms, rotary and store in one kernel. row_amax: a decode's
        output may come as AmaxedRows (kernels/decode_attention.py). window: the layer's sliding
        window, a constant of the kernels (one compiled variant per window); sinks [Hq] (gpt-oss), whether
        there are any a constant too."""
        q = self._rope_store(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping, qk_norm=qk_norm)
        if meta.is_prefill:
            return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                 meta.max_seqlen_q, scale, tiles=meta.attention_tiles, window=window, sinks=sinks)
        return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, row_amax=row_amax,
                            window=window, sinks=sinks)

    def attend_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, row_amax: bool = False, window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor | AmaxedRows:
        """Decode attention of rotated q over a cache that already holds this step's K/V."""
        return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, row_amax=row_amax,
                            window=window, sinks=sinks)


def make_attention_backend(device: torch.device, block_size: int) -> TorchAttention | TritonAttention:
    return TritonAttention(block_size) if device.type == "cuda" else TorchAttention(block_size)
