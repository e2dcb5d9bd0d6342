"""A prefill batch's packed inputs, built on the host in numpy: token ids, positions, KV slots
and per-sequence lengths. The eager prefill and the prefill CUDA graphs both start here.
(Per-token Python would cost milliseconds on a batch of thousands of tokens.)"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphserve.engine.sched.kv_cache import DUMMY_BLOCK
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

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def last_rows(self) -> np.ndarray:
        """[B] int64: the row of each sequence's last token in this step."""
        return self.cu_seqlens[1:].astype(np.int64) - 1


def prefill_inputs(batch: PrefillBatch, block_size: int) -> PrefillInputs:
    """Each sequence's chunk starts at its num_computed_tokens (the cached prefix or the chunks before)."""
    ids, positions, slots = [], [], []
    query_lens = np.asarray(batch.chunk_lens, dtype=np.int64)
    width = max(len(s.block_table) for s in batch.seqs)
    tables = np.full((len(batch.seqs), width), DUMMY_BLOCK, dtype=np.int32)
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.chunk_lens)):
        start = seq.num_computed_tokens
        table = np.asarray(seq.block_table, dtype=np.int64)
        tables[i, :len(table)] = table
        pos = np.arange(start, start + n, dtype=np.int64)
        ids.append(np.asarray(seq.token_ids[start:start + n], dtype=np.int64))
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    starts = np.fromiter((s.num_computed_tokens for s in batch.seqs), dtype=np.int64, count=len(batch.seqs))
    cu = np.zeros(len(batch.seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(query_lens)
    return PrefillInputs(np.concatenate(ids), np.concatenate(positions), np.concatenate(slots), query_lens,
                         (starts + query_lens).astype(np.int32), cu, tables)
