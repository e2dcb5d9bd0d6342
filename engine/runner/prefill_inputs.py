"""A prefill batch's packed inputs, built on the host in numpy: token ids, positions, KV slots
and per-sequence lengths. The eager prefill and the prefill CUDA graphs both start here, and so
does a speculative verify step (each sequence's last token and drafts, a short chunk).
(Per-token Python would cost milliseconds on a batch of thousands of tokens.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphserve.engine.sched.kv_cache import DUMMY_BLOCK
from graphserve.engine.request import Sequence
from graphserve.engine.sched.scheduler import PrefillBatch


@dataclass
class PrefillInputs:
    input_ids: np.ndarray  # [T] int64: the chunks of every sequence, packed
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64: where each token's K/V is written
    query_lens: np.ndarray  # [B] int64: tokens of each sequence in this step
    context_lens: np.ndarray  # [B] int32: KV tokens of each sequence after this step
    cu_seqlens: np.ndarray  # [B+1] int32: prefix sums of query_lens
    block_tables: np.ndarray  # [B, longest table] int32, short rows padded with the dummy block
    lora_slots: np.ndarray | None = None  # [B] int32: each sequence's LoRA adapter slot (-1: none); None: LoRA off
    # KV cache groups after the first (engine/sched/kv_groups.py): each one's (slots, block_tables), as above
    group_tables: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def last_rows(self) -> np.ndarray:
        """[B] int64: the row of each sequence's last token in this step."""
        return self.cu_seqlens[1:].astype(np.int64) - 1


def prefill_inputs(batch: PrefillBatch, block_size: int, num_groups: int = 1) -> PrefillInputs:
    """Each sequence's chunk starts at its num_computed_tokens (the cached prefix or the chunks before).
    num_groups: the KV cache groups, each of its own block tables."""
    starts = [s.num_computed_tokens for s in batch.seqs]
    chunks = [s.token_ids[start:start + n] for s, start, n in zip(batch.seqs, starts, batch.chunk_lens)]
    return pack_chunks(batch.seqs, starts, chunks, block_size, num_groups)


def verify_inputs(seqs: list[Sequence], drafts: list[list[int]], block_size: int, num_groups: int = 1) -> PrefillInputs:
    """A verify step as a prefill batch: each running sequence's chunk is its last token (whose KV is
    not written yet) followed by its drafts, over its cached context. Every sequence must be
    decoding (all tokens but the last computed) with KV slots reserved for the whole chunk."""
    if len(seqs) != len(drafts):
        raise ValueError(f"{len(seqs)} sequences but {len(drafts)} draft lists")
    for seq, proposal in zip(seqs, drafts):
        if seq.num_computed_tokens != seq.num_tokens - 1:
            raise ValueError(f"{seq.request_id}: {seq.num_computed_tokens} of {seq.num_tokens} tokens computed; "
                             "a verify step needs all but the last")
        if len(seq.block_table) * block_size < seq.num_tokens + len(proposal):
            raise ValueError(f"{seq.request_id}: no KV slots reserved for {len(proposal)} drafts")
    starts = [s.num_tokens - 1 for s in seqs]
    chunks = [[s.last_token_id, *proposal] for s, proposal in zip(seqs, drafts)]
    return pack_chunks(seqs, starts, chunks, block_size, num_groups)


def pack_chunks(seqs: list[Sequence], starts: list[int], chunks: list[list[int]], block_size: int,
                num_groups: int = 1) -> PrefillInputs:
    """Sequence i's tokens chunks[i] at positions starts[i], starts[i] + 1, ..., their KV written into its
    blocks (of each of num_groups KV cache groups)."""
    query_lens = np.fromiter(map(len, chunks), dtype=np.int64, count=len(chunks))
    positions = [np.arange(start, start + len(chunk), dtype=np.int64) for start, chunk in zip(starts, chunks)]
    ids = [np.asarray(chunk, dtype=np.int64) for chunk in chunks]
    groups = [_group_tables(seqs, positions, g, block_size) for g in range(num_groups)]
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(query_lens)
    return PrefillInputs(np.concatenate(ids), np.concatenate(positions), groups[0][0], query_lens,
                         (np.asarray(starts, dtype=np.int64) + query_lens).astype(np.int32), cu, groups[0][1],
                         group_tables=groups[1:])


def _group_tables(seqs: list[Sequence], positions: list[np.ndarray], group: int,
                  block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """KV cache group `group`'s slots of the packed positions and its block tables [B, longest]."""
    width = max(len(s.block_tables[group]) for s in seqs)
    tables = np.full((len(seqs), width), DUMMY_BLOCK, dtype=np.int32)
    slots = []
    for i, (seq, pos) in enumerate(zip(seqs, positions)):
        table = np.asarray(seq.block_tables[group], dtype=np.int64)
        tables[i, :len(table)] = table
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    return np.concatenate(slots), tables


def padded_rows(query_lens: np.ndarray, width: int) -> np.ndarray:
    """[T] int64: where each packed token's row goes in a [B * width] layout (sequence b's tokens at
    b * width, b * width + 1, ...): a verify step's logits, [B, k + 1] per position."""
    cu = np.cumsum(query_lens) - query_lens
    seq = np.repeat(np.arange(len(query_lens), dtype=np.int64), query_lens)
    return seq * width + np.arange(int(query_lens.sum()), dtype=np.int64) - np.repeat(cu, query_lens)
