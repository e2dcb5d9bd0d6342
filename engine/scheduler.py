"""Continuous batching: admission under max_num_seqs / token budget / free KV blocks,
chunked prefill, K-step decode rounds with KV reserved up front, preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.kv_cache import BlockManager
from engine.request import Sequence, SequenceStatus


@dataclass
class PrefillBatch:
    seqs: list[Sequence]
    chunk_lens: list[int]  # new tokens computed for each sequence in this step


@dataclass
class DecodeRound:
    seqs: list[Sequence]
    num_steps: int  # K: decode steps before the host looks at the tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remaining_steps(self, seq: Sequence, pending: int = 0) -> int:
        """Tokens `seq` may still generate (max_tokens, which admission capped at the context
        length), less `pending` ones already generated on the device but not appended yet."""
        return seq.params.max_tokens - seq.num_output_tokens - pending

    def _kv_tokens_needed(self, seq: Sequence, num_steps: int, pending: int = 0) -> int:
        """KV slots `seq` needs for a round of `num_steps`: it writes positions
        num_tokens + pending - 1 .. num_tokens + pending - 2 + (the steps it really runs)."""
        return seq.num_tokens + pending - 1 + min(num_steps, self.remaining_steps(seq, pending))

    def schedule(self) -> PrefillBatch | DecodeRound | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> PrefillBatch | None:
        budget = self.config.max_num_batched_tokens
        seqs, chunks = [], []
        for seq in self.running:  # unfinished chunked prefills first
            if seq.in_prefill and budget > 0:
                n = min(seq.num_prefill_tokens - seq.num_computed_tokens, budget)
                seqs.append(seq)
                chunks.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # reserve KV for every token present now, so an admitted prefill never stalls
            need = self.blocks.blocks_needed(seq, seq.num_tokens)
            if not self.blocks.can_allocate(need):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            seq.num_prefill_tokens = seq.num_tokens
            self.running.append(seq)
            n = min(seq.num_prefill_tokens - seq.num_computed_tokens, budget)
            seqs.append(seq)
            chunks.append(n)
            budget -= n
        return PrefillBatch(seqs, chunks) if seqs else None

    def decode_steps(self, pending: int = 0) -> int:
        """K for the next round: the configured chunk, cut short when requests wait for a
        prefill (so their time to first token stays low) or when every sequence ends sooner."""
        k = self.config.decode_chunk
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            k = min(k, 2)
        return max(1, min(k, max(self.remaining_steps(s, pending) for s in self.running)))

    def _schedule_decode(self) -> DecodeRound | None:
        if not self.running:
            return None
        k = self.decode_steps()
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            needed = self._kv_tokens_needed(seq, k)
            if self.blocks.can_allocate(self.blocks.blocks_needed(seq, needed)):
                self.blocks.allocate(seq, needed)
                i += 1
                continue
            victim = self.running[-1]  # the newest request gives way
            self._preempt(victim)
            if victim is seq:
                break
        if not self.running:
            return None
        return DecodeRound(list(self.running), k)

    def schedule_decode_ahead(self, prev: DecodeRound) -> DecodeRound | None:
        """The round after `prev`, scheduled while `prev` is still on the device: the same
        sequences in the same order, each assumed to have prev.num_steps more tokens. None
        unless that is surely what schedule() would decide once `prev` is collected, short
        of a sequence stopping inside `prev` (its extra tokens are then dropped): nothing
        waits, none of prev's sequences has left the batch or would end with `prev`, and
        KV for every one of them fits without preempting."""
        if self.waiting or self.running != prev.seqs:
            return None
        pending = prev.num_steps
        if min(self.remaining_steps(s, pending) for s in prev.seqs) < 1:
            return None
        k = self.decode_steps(pending)
        needed = [self._kv_tokens_needed(s, k, pending) for s in prev.seqs]
        if not self.blocks.can_allocate(sum(self.blocks.blocks_needed(s, n) for s, n in zip(prev.seqs, needed))):
            return None
        for seq, n in zip(prev.seqs, needed):
            self.blocks.allocate(seq, n)
        return DecodeRound(list(prev.seqs), k)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
