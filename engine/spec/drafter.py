"""What every drafter offers the engine: per-request state hooks and a batched propose.

A drafter sees a request's tokens (prompt, then each accepted token) and proposes up to a given
number of next tokens. The verify step (engine/sample/rejection_sampler.py) only sees the proposals as tensors, so an
n-gram table, a draft model or an EAGLE head can sit behind this interface without changing it.
A drafter whose tokens come from the device (a draft model) may leave them there
(propose_on_device): the verify step reads them in stream order, so the host stages it while the
drafts are still being made.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class DeviceDrafts:
    """Proposals still on the device, written by work queued on its current stream: per requested
    request its number of drafts and its row of `tokens` [R, k] (the drafts first, then anything)."""

    counts: list[int]
    rows: list[int]
    tokens: torch.Tensor


class Drafter(ABC):
    """Proposes draft tokens for running requests. Rejected drafts never reach the hooks: the
    request's token list is prompt + accepted output, as the engine's Sequence holds it."""

    @abstractmethod
    def add_request(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Start tracking a request whose tokens so far are `token_ids` (its prompt, or prompt and
        output when it is re-admitted)."""

    @abstractmethod
    def on_append(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens the engine appended to the request (accepted drafts and the correction/bonus)."""

    @abstractmethod
    def on_finish(self, request_id: str) -> None:
        """The request ended (finished, aborted): drop its state."""

    @abstractmethod
    def propose(self, request_ids: Sequence[str], max_drafts: Sequence[int]) -> list[list[int]]:
        """Per request, up to max_drafts[i] draft tokens (possibly none) continuing its tokens."""

    def propose_on_device(self, request_ids: Sequence[str], max_drafts: Sequence[int]) -> DeviceDrafts | None:
        """propose's drafts left on the device, not waited for; None where this drafter makes them on
        the host (then the caller calls propose)."""
        return None


def pack_drafts(drafts: Sequence[Sequence[int]], k: int, device: torch.device | str = "cpu",
                pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Host proposals -> (draft token ids [B, k] int64, padded with `pad_token_id`; number of
    drafts per row [B] int64), the static-shape form the verify step takes."""
    tokens = torch.full((len(drafts), k), pad_token_id, dtype=torch.int64)
    counts = torch.zeros(len(drafts), dtype=torch.int64)
    for row, proposal in enumerate(drafts):
        if len(proposal) > k:
            raise ValueError(f"row {row} has {len(proposal)} drafts, more than k = {k}")
        tokens[row, : len(proposal)] = torch.tensor(proposal, dtype=torch.int64)
        counts[row] = len(proposal)
    return tokens.to(device), counts.to(device)
