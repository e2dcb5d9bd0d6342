"""A speculative verify step laid out as decode rows: each sequence's last token and its k drafts
become k + 1 rows of one decode step (row j: token j at position num_tokens - 1 + j, with its own
context length, over the sequence's block table), so the decode graphs score every position as
plain decoding would. Rows past a sequence's drafts are padding: position 0, the dummy slot."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphserve.engine.request import Sequence
from graphserve.engine.runner.prefill_inputs import padded_rows, verify_inputs
from graphserve.engine.sched.kv_cache import DUMMY_BLOCK


@dataclass
class VerifyRows:
    input_ids: np.ndarray  # [B * (k + 1)] int64
    positions: np.ndarray  # [B * (k + 1)] int64
    slots: np.ndarray  # [B * (k + 1)] int64: where each row's K/V is written
    block_tables: np.ndarray  # [B * (k + 1), longest table] int32: each sequence's, repeated per row
    # KV cache groups after the first: each one's (slots, block_tables), as above
    group_tables: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def context_lens(self) -> np.ndarray:
        return (self.positions + 1).astype(np.int32)


def verify_rows(seqs: list[Sequence], drafts: list[list[int]], k: int, block_size: int,
                num_groups: int = 1) -> VerifyRows:
    """The rows of a verify step of `seqs` with their drafts (at most k each; their KV slots reserved
    by the caller: verify_inputs checks)."""
    if any(len(proposal) > k for proposal in drafts):
        raise ValueError(f"more than k = {k} drafts in a row")
    width = k + 1
    rows = len(seqs) * width
    packed = verify_inputs(seqs, drafts, block_size, num_groups)
    at = padded_rows(packed.query_lens, width)  # each packed token's row among the B x (k + 1)
    ids = np.zeros(rows, dtype=np.int64)
    ids[at] = packed.input_ids
    positions = np.zeros(rows, dtype=np.int64)
    positions[at] = packed.positions
    groups = []
    for packed_slots, tables in [(packed.slots, packed.block_tables), *packed.group_tables]:
        slots = np.full(rows, DUMMY_BLOCK * block_size, dtype=np.int64)
        slots[at] = packed_slots
        groups.append((slots, np.repeat(tables, width, axis=0)))
    return VerifyRows(ids, positions, *groups[0], group_tables=groups[1:])
