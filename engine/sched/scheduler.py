"""Continuous batching: admission under max_num_seqs / token budget / free KV blocks,
chunked prefill, K-step decode rounds with KV reserved up front, preemption by recompute."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from graphserve.engine.config import EngineConfig
from graphserve.engine.sched.kv_groups import KVGroups
from graphserve.engine.request import Sequence, SequenceStatus


@dataclass
class PrefillBatch:
    seqs: list[Sequence]
    chunk_lens: list[int]  # new tokens computed for each sequence in this step
    # the last this many sequences are running decodes riding along, one token each
    # (Scheduler.mix_decodes: on CPU, where a prefill step is compute-bound and a decode
    # row in it costs next to nothing)
    num_decodes: int = 0


@dataclass
class DecodeRound:
    seqs: list[Sequence]
    num_steps: int  # K: decode steps before the host looks at the tokens
    # per sequence: tokens it generated on the device that the host has not appended yet
    # (a round launched while the round before it was still in flight); None: all 0
    pending: list[int] | None = None


class Scheduler:
    def __init__(self, config: EngineConfig, kv_groups: KVGroups, mix_decodes: bool = False):
        self.config = config
        self.blocks = kv_groups  # every decision on KV blocks is taken on all its groups at once
        # prefill steps also advance the running decodes by one token (eager engines: CPU)
        self.mix_decodes = mix_decodes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_queried_tokens = 0  # tokens looked up in the prefix cache at admission
        self.num_cached_tokens = 0  # of them, found there

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remaining_steps(self, seq: Sequence, pending: int = 0) -> int:
        """Tokens `seq` may still generate (Sequence.num_tokens_left), less `pending` ones
        already generated on the device but not appended yet."""
        return seq.num_tokens_left - pending

    def _kv_tokens_needed(self, seq: Sequence, num_steps: int, pending: int = 0) -> int:
        """KV slots `seq` needs for a round of `num_steps`: it writes positions
        num_tokens + pending - 1 .. num_tokens + pending - 2 + (the steps it really runs)."""
        return seq.num_tokens + pending - 1 + min(num_steps, self.remaining_steps(seq, pending))

    def drop_out_of_window(self) -> None:
        """The windowed groups: the running sequences give back the blocks no later query of theirs reads
        (BlockManager.drop_out_of_window), before anything is scheduled; nothing without a window."""
        for seq in self.running:
            self.blocks.drop_out_of_window(seq)

    def schedule(self) -> PrefillBatch | DecodeRound | None:
        batch = self.schedule_prefill()
        if batch is not None:
            if self.mix_decodes:
                self._add_decodes(batch)
            return batch
        return self._schedule_decode()

    def _add_decodes(self, batch: PrefillBatch) -> None:
        """The running sequences that are decoding join the prefill step with their last
        token (its KV written, the next token sampled), while free KV lasts (never preempts)."""
        in_batch = set(map(id, batch.seqs))
        for seq in self.running:
            if id(seq) in in_batch or seq.in_prefill or self.remaining_steps(seq) < 1:
                continue
            needed = self._kv_tokens_needed(seq, 1)
            if not self.blocks.can_grow(seq, needed):
                break
            self.blocks.allocate(seq, needed)
            batch.seqs.append(seq)
            batch.chunk_lens.append(1)
            batch.num_decodes += 1

    def schedule_prefill(self) -> PrefillBatch | None:
        """Unfinished chunked prefills, then waiting requests, within the token budget and
        the KV blocks that are free (admission never preempts)."""
        self.drop_out_of_window()
        budget = self.config.max_num_batched_tokens
        seqs, chunks = [], []
        for seq in self.running:  # unfinished chunked prefills first
            if seq.in_prefill and budget > 0:
                n = min(seq.num_prefill_tokens - seq.num_computed_tokens, budget)
                end = seq.num_computed_tokens + n  # (a windowed pool allocates chunk by chunk)
                if not self.blocks.can_grow(seq, end):
                    continue  # a block it shared went back to no pool: it waits for one
                self.blocks.allocate(seq, end)
                seqs.append(seq)
                chunks.append(n)
                budget -= n
        deferred = []
        adapters = self.running_adapters() if self.config.enable_lora else set()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            lora_id = seq.lora.lora_id if seq.lora is not None else None
            if lora_id is not None and lora_id not in adapters and len(adapters) >= self.config.max_loras:
                deferred.append(self.waiting.popleft())  # its adapter waits for a device slot (max_loras)
                continue
            # the prompt's longest cached prefix (echo's prompt logprobs need every prompt position)
            keys = self.blocks.prefix_keys(seq) if seq.params.prompt_logprobs is None else []
            hit = self.blocks.cached_prefix(seq, keys)  # per group, each as long
            cached = len(hit[0])
            if cached < len(keys) and self.blocks.being_computed(keys[cached]):
                deferred.append(self.waiting.popleft())  # a prefill admitted before computes its next block
                continue
            # reserve KV for every token present now, so an admitted prefill never stalls
            need = self.blocks.prefill_blocks(seq, hit, self.config.max_num_batched_tokens)
            if not self.blocks.can_admit(need, hit):
                break
            self.waiting.popleft()
            if seq.scheduled_at is None:
                seq.scheduled_at = time.monotonic()
            self.blocks.mark_computing(seq, keys[cached:])
            if cached:
                seq.num_computed_tokens = cached * self.blocks.block_size
                if seq.num_output_tokens == 0:
                    seq.num_cached_tokens = seq.num_computed_tokens
                self.num_cached_tokens += seq.num_computed_tokens
            self.num_queried_tokens += seq.num_tokens
            seq.status = SequenceStatus.RUNNING
            seq.num_prefill_tokens = seq.num_tokens
            n = min(seq.num_prefill_tokens - seq.num_computed_tokens, budget)
            self.blocks.admit(seq, hit, need, seq.num_computed_tokens + n)
            self.running.append(seq)
            if lora_id is not None:
                adapters.add(lora_id)
            seqs.append(seq)
            chunks.append(n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # at the head again, in their order
        return PrefillBatch(seqs, chunks) if seqs else None

    def running_adapters(self) -> set[int]:
        """The LoRA adapters (ids) of the running requests: at most max_loras, each in a device slot."""
        return {s.lora.lora_id for s in self.running if s.lora is not None}

    def can_admit_waiting(self) -> bool:
        """Requests wait for a prefill and the batch has room for them."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def end_round_early(self, num_waiting_at_start: int) -> bool:
        """Between two steps of a round run synchronously (CPU): whether to end it now, because
        requests arrived during it that a prefill could take (their first token then waits for
        one decode step, not the rest of the round)."""
        return len(self.waiting) > num_waiting_at_start and self.can_admit_waiting()

    def decode_steps(self, seqs: list[Sequence], pending: list[int] | None = None) -> int:
        """K for a round of `seqs`: the configured chunk, cut short when requests wait for a
        prefill (so their time to first token stays low) or when every sequence ends sooner."""
        k = self.config.decode_chunk
        if self.can_admit_waiting():
            k = min(k, 2)
        pending = pending or [0] * len(seqs)
        return max(1, min(k, max(self.remaining_steps(s, p) for s, p in zip(seqs, pending))))

    def _schedule_decode(self) -> DecodeRound | None:
        if not self.running:
            return None
        k = self.decode_steps(self.running)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            needed = self._kv_tokens_needed(seq, k)
            if self.blocks.can_grow(seq, needed):
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
        """The round after `prev`, scheduled while `prev` is still on the device: first prev's
        sequences that surely continue (not ended, not reaching max_tokens within prev), each
        with prev.num_steps tokens pending, in prev's order; then the running sequences that
        are ready to decode but were not in prev (prefilled meanwhile). A sequence that stops
        inside prev (EOS, a stop string) has its extra tokens dropped. None when no sequence
        is left, or when KV for all of them does not fit without preempting (schedule()
        decides then, once prev is collected)."""
        self.drop_out_of_window()  # (prev reads no position before the host's num_computed_tokens)
        steps = prev.num_steps
        seqs = [s for s in prev.seqs if not s.is_finished and self.remaining_steps(s, steps) >= 1]
        pending = [steps] * len(seqs)
        in_prev = set(map(id, prev.seqs))
        fresh = [s for s in self.running if id(s) not in in_prev and not s.in_prefill and not s.is_finished]
        seqs += fresh
        pending += [0] * len(fresh)
        if not seqs:
            return None
        k = self.decode_steps(seqs, pending)
        needed = [self._kv_tokens_needed(s, k, p) for s, p in zip(seqs, pending)]
        if not self.blocks.can_grow_all(seqs, needed):
            return None
        for seq, n in zip(seqs, needed):
            self.blocks.allocate(seq, n)
        return DecodeRound(seqs, k, pending)

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
