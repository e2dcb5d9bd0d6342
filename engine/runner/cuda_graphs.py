"""CUDA graphs for decode steps: one graph per (batch bucket, sampler variant), captured
at start-up largest first into one shared memory pool, replayed over static buffers.

A round with B sequences is padded to the smallest bucket >= B; padded rows read block 0
(the dummy block) and write their K/V only there. Each replay is one whole decode step,
sampling included, and feeds the sampled token into the next step on the device.

A round with grammar-constrained rows replays, per step, a forward graph (the logits into
a static buffer) and a masked sampling graph, with the step's masks fed in between while
the round runs (engine/structured/mask_feed.py), so those rows keep K-step rounds, launched ahead too.

A speculative verify step replays a forward graph too: each sequence's last token and drafts as
k + 1 rows of one decode step (verify_logits), so drafts are scored by decode's own forward pass.

A round is launched (staged, replayed, its tokens queued for the host) and collected
(wait, read) separately, so the engine can launch the next round before it waits for
this one. Everything runs on one CUDA stream: a round's input copies run after the
previous round's replays, and its token copy before the next round's replays.

On CPU (tests) the same static-buffer path runs eagerly, so padding and buffer handling
are checked without a GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from graphserve.engine import gc_stats
from graphserve.engine.sched.kv_cache import DUMMY_BLOCK
from graphserve.engine.structured.mask_feed import FeedJob, MaskFeed
from graphserve.engine.request import Sequence
from graphserve.engine.runner.decode_buffers import DecodeBuffers
from graphserve.engine.runner.host_slots import HostSlot, RoundHandle, group_buffer_name
from graphserve.engine.runner.model_runner import DecodeState, ModelRunner, StepTokens, plan_steps
from graphserve.engine.runner.verify_rows import verify_rows
from graphserve.engine.sample.sampler import build_sampling_tensors
from graphserve.engine.sched.scheduler import DecodeRound

logger = logging.getLogger("graphserve.engine")

# all-greedy batches skip the sort and the noise; "masked" ones apply grammar bitmasks and
# sample only: they follow the "forward" graph, which leaves the logits in a static buffer
VARIANTS = ("greedy", "sample", "forward", "greedy_masked", "sample_masked")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (at most 512)."""
    max_batch = max(1, min(max_batch, 512))
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch]
    buckets += list(range(16, max_batch + 1, 8))
    if buckets[-1] != max_batch:
        buckets.append(-(-max_batch // 8) * 8 if max_batch > 8 else max_batch)
    return sorted(set(buckets))


def eager_reason(seqs: list[Sequence], max_bucket: int) -> str | None:
    """Why a round cannot use the graphs, or None if it can."""
    if len(seqs) > max_bucket:
        return "batch_exceeds_largest_bucket"
    for s in seqs:
        p = s.params
        if p.logprobs:
            return "top_logprobs"
        if p.needs_penalties or p.logit_bias or p.min_tokens > 0:
            return "logits_processors"
    return None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    state: DecodeState  # views of the static buffers, `bucket` rows


class GraphDecoder:
    def __init__(self, runner: ModelRunner, max_batch: int, max_steps: int, table_width: int,
                 use_cuda_graphs: bool = True, variants: tuple[str, ...] = VARIANTS):
        """variants: the sampler variants captured (a draft model's greedy rounds need only "greedy")."""
        self.runner = runner
        self.variants = variants
        self.device = runner.device
        self.buckets = batch_buckets(max_batch)
        self.max_bucket = self.buckets[-1]
        self.max_steps = max_steps
        self.table_width = table_width
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.buffers = DecodeBuffers(self.max_bucket, max_steps, table_width, runner.vocab_size, runner.block_size,
                                     self.device, lora=runner.lora, num_groups=runner.num_groups)
        self._feed: MaskFeed | None = None  # the masks of rounds with grammar rows, made by capture()
        self._last_feed_rows: dict[int, int] = {}  # the last launch's constrained rows: batch row -> compact
        self.graphs: dict[tuple[int, str], _Graph] = {}
        self.capture_seconds = 0.0  # of the last capture(), and the GPU memory it took
        self.capture_gib = 0.0
        self.pool = None
        pin = self.device.type == "cuda"
        staged = self.buffers.staged()
        self._slots = [HostSlot(staged, self.buffers.out_tokens, self.buffers.out_logprobs, pin) for _ in range(2)]
        self._next_slot = 0
        self._last_seqs: list[Sequence] | None = None  # the rows of the last launch, while it is valid

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Capture every (bucket, variant), largest bucket first, into one memory pool."""
        masked = any(v.endswith("_masked") for v in self.variants)
        if self._feed is None and masked:  # one feed (and worker thread) however often the graphs are captured
            self._feed = MaskFeed(self.max_bucket, self.buffers.token_bitmask.shape[1], self.max_steps, self.device)
        if not self.use_cuda_graphs:
            self.graphs = {(b, v): _Graph(None, self.buffers.state(b, v)) for b in self.buckets for v in self.variants}
            return
        from tqdm import tqdm

        torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        # what the caching allocator holds (the graph pool is in it), not device-wide free memory,
        # which other work freeing memory at the same time would distort
        mem_before = torch.cuda.memory_reserved(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        if "forward" in self.variants:  # the forward graph's output, which the masked graphs read
            self.buffers.logits = torch.empty(self.max_bucket, self.runner.vocab_size, device=self.device,
                                      dtype=self.runner.model.lm_head_weight.dtype)
        todo = [(b, v) for b in reversed(self.buckets) for v in self.variants]
        with gc_stats.paused():
            for bucket, variant in tqdm(todo, desc="capturing CUDA graphs", disable=not progress):
                state = self.buffers.state(bucket, variant)
                run = self._graph_body(bucket, variant, state)
                self.buffers.reset_padding(0, self.max_bucket)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up outside the graph (Triton compiles, allocator settles)
                    self.buffers.step.zero_()
                    run()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                self.buffers.step.zero_()
                with torch.cuda.graph(graph, pool=self.pool):
                    run()
                self.graphs[(bucket, variant)] = _Graph(graph, state)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        self.capture_gib = (torch.cuda.memory_reserved(self.device) - mem_before) / 1024**3
        logger.info("captured %d CUDA graphs (%d buckets up to %d) in %.1fs using %.2f GiB",
                    len(todo), len(self.buckets), self.max_bucket, self.capture_seconds, self.capture_gib)

    def _graph_body(self, bucket: int, variant: str, state: DecodeState):
        """What the graph of (bucket, variant) runs: a whole step, the forward pass alone, or
        (masked) the sampling alone."""
        if variant == "forward":
            return lambda: self.buffers.logits[:bucket].copy_(self.runner.decode_forward(state))
        if variant.endswith("_masked"):
            return lambda: self.runner.decode_sample(state, self.buffers.logits[:bucket])
        return lambda: self.runner.decode_step(state)

    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _take_slot(self) -> HostSlot:
        """The host buffers for the next launch, once the device is done with them (they were
        last used two launches ago, a round the engine has collected by now)."""
        slot = self._slots[self._next_slot]
        self._next_slot = 1 - self._next_slot
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        slot.launches += 1
        return slot

    def _carried_rows(self, rnd: DecodeRound) -> list[int] | None:
        """For each row of `rnd`, the row of the last launch whose last sampled token it
        continues from (its pending tokens were made there), or -1 when the host has its
        last token; None when no row carries one."""
        if not rnd.pending or not any(rnd.pending):
            return None
        last = {id(s): row for row, s in enumerate(self._last_seqs or [])}
        rows = []
        for seq, pending in zip(rnd.seqs, rnd.pending):
            if pending and id(seq) not in last:
                raise ValueError("a sequence with pending tokens must come from the last launched round")
            rows.append(last[id(seq)] if pending else -1)
        return rows

    def _stage_inputs(self, slot: HostSlot, rnd: DecodeRound) -> tuple[str, list[int], list[int]]:
        """Fill the slot's host buffers for `rnd` and queue their copies into the static
        buffers; returns the sampler variant, the rows constrained by a grammar and, for each,
        its compact row in the last launch when it continues from there (else -1)."""
        seqs, k, b, pending = rnd.seqs, rnd.num_steps, len(rnd.seqs), rnd.pending
        carried = self._carried_rows(rnd)
        structured = self.runner.structured
        rows = structured.constrained_rows(seqs) if structured is not None else []
        lead_from = [self._last_feed_rows.get(carried[i], -1) if carried is not None and carried[i] >= 0 else -1
                     for i in rows]
        # a decoder of greedy graphs alone (a draft model's) reads no sampling input: none is staged
        st = None if self.variants == ("greedy",) else build_sampling_tensors(
            seqs, self.runner.vocab_size, self.runner.eos_ids, torch.device("cpu"), pending)
        tables = []  # each KV cache group's
        for g in range(self.runner.num_groups):
            table = slot.view(group_buffer_name("block_tables", g), (b, self.table_width))
            table.fill_(DUMMY_BLOCK)
            for i, s in enumerate(seqs):
                table[i, :len(s.block_tables[g])] = torch.tensor(s.block_tables[g], dtype=torch.int32)
            tables.append(table)
        positions, slots, context_lens = plan_steps(seqs, k, tables, self.runner.block_size, pending)
        values = {"step_positions": positions, "step_context_lens": context_lens,
                  **{group_buffer_name("step_slots", g): group_slots for g, group_slots in enumerate(slots)},
                  **{name: getattr(st, name) for name in ("temperature", "top_k", "top_p", "min_p", "seeds",
                                                          "output_pos") if st is not None}}
        if self.runner.lora:
            values["lora_slots"] = torch.tensor([s.lora_slot for s in seqs], dtype=torch.int32)
        host = {name: slot.stage(name, src) for name, src in values.items()}
        host.update({group_buffer_name("block_tables", g): table for g, table in enumerate(tables)})
        non_blocking = self.device.type == "cuda"
        for name, src in host.items():
            self.buffers.rows(name, k, b).copy_(src, non_blocking=non_blocking)
        self._stage_input_ids(slot, seqs, carried, non_blocking)
        if rows:  # their masks come from the feed, step by step; the other rows allow everything
            self.buffers.token_bitmask[:b].fill_(-1)
            self.buffers.mask_rows[:len(rows)].copy_(slot.stage("mask_rows", torch.tensor(rows)), non_blocking=non_blocking)
        return ("greedy" if st is None or st.all_greedy else "sample") + ("_masked" if rows else ""), rows, lead_from

    def _stage_input_ids(self, slot: HostSlot, seqs: list[Sequence], carried: list[int] | None,
                         non_blocking: bool) -> None:
        """The token each row feeds in: from the host, or (a carried row) the last token the
        row's sequence sampled in the last launch, which is on the device only; gathered
        there, in stream order after that launch."""
        b = len(seqs)
        if carried == list(range(len(self._last_seqs or []))) and b == len(carried):
            return  # the same rows in the same order: input_ids holds them already
        ids = slot.stage("input_ids", torch.tensor([s.last_token_id if carried is None or carried[i] < 0 else 0
                                                    for i, s in enumerate(seqs)]))
        if carried is None:
            self.buffers.input_ids[:b].copy_(ids, non_blocking=non_blocking)
            return
        rows = self.buffers.input_rows[:b]
        rows.copy_(slot.stage("input_rows", torch.tensor(carried)), non_blocking=non_blocking)
        from_device = self.buffers.input_ids.index_select(0, rows.clamp(min=0))
        self.buffers.input_ids[:b].copy_(ids, non_blocking=non_blocking)
        torch.where(rows >= 0, from_device, self.buffers.input_ids[:b], out=self.buffers.input_ids[:b])

    @torch.inference_mode()
    def launch(self, rnd: DecodeRound) -> RoundHandle:
        """Stage a round, queue its K replays and the copy of its tokens to the host, and
        return without waiting for the device (on CPU the steps run here, eagerly).

        `rnd.pending`: a sequence with pending tokens continues a row of the last launch,
        which generated them and whose last one is in the static input_ids (each step
        writes its sampled token there); its positions, slots and sampling noise are shifted
        by them."""
        seqs, k = rnd.seqs, rnd.num_steps
        self._carried_rows(rnd)  # checks before anything is staged
        b = len(seqs)
        bucket = self.bucket_for(b)
        slot = self._take_slot()
        non_blocking = self.device.type == "cuda"
        try:
            job = None
            try:
                variant, rows, lead_from = self._stage_inputs(slot, rnd)
                self.buffers.reset_padding(b, bucket)
                self.buffers.step.zero_()
                entry = self.graphs[(bucket, variant)]
                if rows and not self.use_cuda_graphs:  # CPU: served while the steps run here
                    job = self._submit(seqs, rows, lead_from, k)
                for i in range(k):
                    if rows:
                        self._masked_step(i, bucket, entry, len(rows))
                    elif entry.graph is not None:
                        entry.graph.replay()
                    else:
                        self.runner.decode_step(entry.state)
                if rows and self.use_cuda_graphs:  # CUDA: once its waits, copies and events are queued
                    job = self._submit(seqs, rows, lead_from, k)
            except BaseException:
                self._last_seqs = None  # input_ids may be half restaged or half stepped
                self._last_feed_rows = {}
                if self._feed is not None:
                    if job is not None:
                        self._feed.cancel(job)
                    self._feed.release_waits()
                raise
            # the next round's replays overwrite out_tokens: copy them out first, in stream order.
            # Whole leading rows are contiguous on both sides: one DMA straight into pinned memory.
            slot.tokens[:k].copy_(self.buffers.out_tokens[:k], non_blocking=non_blocking)
            slot.logprobs[:k].copy_(self.buffers.out_logprobs[:k], non_blocking=non_blocking)
        finally:  # also after a failure: the slot is reused only once the device is done with it
            if non_blocking:
                slot.event = torch.cuda.Event()
                slot.event.record(torch.cuda.current_stream(self.device))
        self._last_seqs = list(seqs)
        self._last_feed_rows = {row: j for j, row in enumerate(rows)}
        return RoundHandle(rnd, bucket, slot, slot.launches, slot.event, job)

    def verify_fits(self, num_seqs: int, k: int) -> bool:
        """Whether a verify step of `num_seqs` sequences with k drafts each fits a bucket."""
        return num_seqs * (k + 1) <= self.max_bucket

    @torch.inference_mode()
    def verify_logits(self, seqs: list[Sequence], drafts: list[list[int]], k: int,
                      device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Speculative decoding's verify step through the decode graphs: the rows of verify_rows
        (each sequence's last token and drafts, k + 1 rows of one decode step), scored by the
        "forward" graph of the bucket of B * (k + 1) rows, as plain decoding would score them. Returns the logits [B, k + 1, V] (model dtype), a view of a
        static buffer valid until the next launch. The slots of the drafts are reserved by the
        caller; nothing here changes the sequences. The host waits for the step (the next drafts
        need its tokens), so no round may be in flight. device_tokens [B, k] (drafts still being
        made on the device, in stream order): row i's drafts are read from its row there, and
        `drafts` give only their number."""
        b, width = len(seqs), k + 1
        rows = b * width
        if not self.verify_fits(b, k):
            raise ValueError(f"{b} sequences x {width} positions exceed the largest bucket {self.max_bucket}")
        # checks: decoding, draft slots reserved
        layout = verify_rows(seqs, drafts, k, self.runner.block_size, self.runner.num_groups)
        bucket = self.bucket_for(rows)
        slot = self._take_slot()
        non_blocking = self.device.type == "cuda"
        values = {"input_ids": torch.from_numpy(layout.input_ids),
                  "step_positions": torch.from_numpy(layout.positions[None, :]),
                  "step_context_lens": torch.from_numpy(layout.context_lens[None, :])}
        tables = {}  # each KV cache group's
        for g, (group_slots, group_tables) in enumerate([(layout.slots, layout.block_tables), *layout.group_tables]):
            values[group_buffer_name("step_slots", g)] = torch.from_numpy(group_slots[None, :])
            table = tables[group_buffer_name("block_tables", g)] = slot.view(group_buffer_name("block_tables", g),
                                                                       (rows, self.table_width))
            table.fill_(DUMMY_BLOCK)
            table[:, :group_tables.shape[1]] = torch.from_numpy(group_tables)
        if self.runner.lora:  # each sequence's k + 1 rows run with its adapter
            values["lora_slots"] = torch.tensor([s.lora_slot for s in seqs], dtype=torch.int32).repeat_interleave(width)
        try:
            for name, src in values.items():
                self.buffers.rows(name, 1, rows).copy_(slot.stage(name, src), non_blocking=non_blocking)
            for name, table in tables.items():
                self.buffers.rows(name, 1, rows).copy_(table, non_blocking=non_blocking)
            if device_tokens is not None:  # rows past a sequence's drafts take tokens too: padding, never read
                self.buffers.input_ids[:rows].view(b, width)[:, 1:].copy_(device_tokens[:, :k])
            self.buffers.reset_padding(rows, bucket)
            self.buffers.step.zero_()
            entry = self.graphs[(bucket, "forward")]
            if entry.graph is not None:
                entry.graph.replay()
                logits = self.buffers.logits
            else:  # CPU: the same static rows, eagerly
                logits = self.runner.decode_forward(entry.state)
        finally:
            self._last_seqs = None  # input_ids no longer holds the last round's tokens
            self._last_feed_rows = {}
            if non_blocking:
                slot.event = torch.cuda.Event()
                slot.event.record(torch.cuda.current_stream(self.device))
        return logits[:rows].view(b, width, -1)

    @property
    def feeds_masks(self) -> bool:
        """Rounds with grammar rows run K steps and may be launched ahead (their masks are fed)."""
        return self._feed is not None

    def _submit(self, seqs: list[Sequence], rows: list[int], lead_from: list[int], k: int) -> FeedJob:
        return self._feed.submit(list(seqs), rows, lead_from, k, self.runner.structured.advance)

    def _masked_step(self, i: int, bucket: int, entry: _Graph, num_rows: int) -> None:
        """Step i of a round with grammar rows: the forward graph, the wait for and copy of the
        step's masks, the masked sampling graph, and the copy of the constrained rows' tokens
        for the feed (on CPU the wait comes first and the step runs whole)."""
        device_rows = self.buffers.mask_rows[:num_rows]
        if entry.graph is not None:
            self.graphs[(bucket, "forward")].graph.replay()
            self._feed.queue_masks(self.buffers.token_bitmask, device_rows)
            entry.graph.replay()
        else:
            self._feed.queue_masks(self.buffers.token_bitmask, device_rows)
            self.runner.decode_step(entry.state)
        self._feed.queue_tokens(self.buffers.out_tokens[i], device_rows)

    def drain_feed(self) -> None:
        """Until every launched round's masks are served (before matchers are rolled back)."""
        if self._feed is not None:
            self._feed.drain()

    def is_done(self, handle: RoundHandle) -> bool:
        """Whether a launched round's tokens have reached the host (collect would not wait)."""
        return handle.event is None or handle.event.query()

    def collect(self, handle: RoundHandle) -> tuple[dict[str, StepTokens], int]:
        """Wait for a launched round's tokens; returns them per sequence, and the bucket used.
        Collect a round before launching the one after the next (they share host buffers)."""
        slot = handle.slot
        if slot.launches != handle.launch_index:
            raise RuntimeError("a round was collected after its host buffers went to a later round")
        if handle.event is not None:
            handle.event.synchronize()
        if handle.job is not None:
            self._feed.wait_taken(handle.job)
            if timeouts := self._feed.take_timeouts():
                logger.error("%d grammar mask waits gave up: the host did not answer the device in time", timeouts)
        k, b = handle.rnd.num_steps, len(handle.rnd.seqs)
        results = self.runner.tokens_by_seq(handle.rnd.seqs, slot.tokens[:k, :b], slot.logprobs[:k, :b])
        return results, handle.bucket
