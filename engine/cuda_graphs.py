"""CUDA graphs for decode steps: one graph per (batch bucket, sampler variant), captured
at start-up largest first into one shared memory pool, replayed over static buffers.

A round with B sequences is padded to the smallest bucket >= B; padded rows read block 0
(the dummy block) and write their K/V only there. Each replay is one whole decode step,
sampling included, and feeds the sampled token into the next step on the device.

On CPU (tests) the same static-buffer path runs eagerly, so padding and buffer handling
are checked without a GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.kv_cache import DUMMY_BLOCK
from engine.request import Sequence
from engine.runner import DecodeState, ModelRunner, StepTokens, plan_steps
from engine.sampler import SamplingTensors, build_sampling_tensors
from engine.scheduler import DecodeRound

logger = logging.getLogger("graphserve.engine")

VARIANTS = ("greedy", "sample")  # all-greedy batches skip the sort and the noise


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
                 use_cuda_graphs: bool = True):
        self.runner = runner
        self.device = runner.device
        self.buckets = batch_buckets(max_batch)
        self.max_bucket = self.buckets[-1]
        self.max_steps = max_steps
        self.table_width = table_width
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        n, dev = self.max_bucket, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.step_positions = torch.zeros(max_steps, n, dtype=torch.int64, device=dev)
        self.step_slots = torch.zeros(max_steps, n, dtype=torch.int64, device=dev)
        self.step_context_lens = torch.ones(max_steps, n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((n, table_width), DUMMY_BLOCK, dtype=torch.int32, device=dev)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=dev)
        self.output_pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.step = torch.zeros((), dtype=torch.int64, device=dev)
        self.out_tokens = torch.zeros(max_steps, n, dtype=torch.int64, device=dev)
        self.out_logprobs = torch.zeros(max_steps, n, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, str], _Graph] = {}
        self.pool = None

    def _state(self, bucket: int, variant: str) -> DecodeState:
        st = SamplingTensors(
            temperature=self.temperature[:bucket], top_k=self.top_k[:bucket], top_p=self.top_p[:bucket],
            min_p=self.min_p[:bucket], seeds=self.seeds[:bucket], output_pos=self.output_pos[:bucket],
            all_greedy=variant == "greedy", use_top_filters=variant == "sample")
        return DecodeState(
            input_ids=self.input_ids[:bucket], step_positions=self.step_positions[:, :bucket],
            step_slots=self.step_slots[:, :bucket], step_context_lens=self.step_context_lens[:, :bucket],
            block_tables=self.block_tables[:bucket], sampling=st, step=self.step,
            out_tokens=self.out_tokens[:, :bucket], out_logprobs=self.out_logprobs[:, :bucket])

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Capture every (bucket, variant), largest bucket first, into one memory pool."""
        if not self.use_cuda_graphs:
            self.graphs = {(b, v): _Graph(None, self._state(b, v)) for b in self.buckets for v in VARIANTS}
            return
        from tqdm import tqdm

        started = time.perf_counter()
        mem_before = torch.cuda.mem_get_info(self.device)[0]
        self.pool = torch.cuda.graph_pool_handle()
        todo = [(b, v) for b in reversed(self.buckets) for v in VARIANTS]
        for bucket, variant in tqdm(todo, desc="capturing CUDA graphs", disable=not progress):
            state = self._state(bucket, variant)
            self._reset_padding(0, self.max_bucket)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the graph (Triton compiles, allocator settles)
                self.step.zero_()
                self.runner.decode_step(state)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self.step.zero_()
            with torch.cuda.graph(graph, pool=self.pool):
                self.runner.decode_step(state)
            self.graphs[(bucket, variant)] = _Graph(graph, state)
        torch.cuda.synchronize()
        used = (mem_before - torch.cuda.mem_get_info(self.device)[0]) / 1024**3
        logger.info("captured %d CUDA graphs (%d buckets up to %d) in %.1fs using %.2f GiB",
                    len(todo), len(self.buckets), self.max_bucket, time.perf_counter() - started, used)

    def bucket_for(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _reset_padding(self, start: int, end: int) -> None:
        """Rows start..end-1 become inert: dummy block, position 0, greedy. (A bucket's graph
        reads only its own rows, so rows past the bucket need no reset.)"""
        if start >= end:
            return
        for t, value in ((self.input_ids, 0), (self.temperature, 0.0), (self.seeds, 0), (self.output_pos, 0),
                         (self.min_p, 0.0), (self.top_p, 1.0), (self.top_k, self.runner.vocab_size),
                         (self.block_tables, DUMMY_BLOCK)):
            t[start:end].fill_(value)
        for t, value in ((self.step_positions, 0), (self.step_slots, DUMMY_BLOCK * self.runner.block_size),
                         (self.step_context_lens, 1)):
            t[:, start:end].fill_(value)

    @torch.inference_mode()
    def run(self, rnd: DecodeRound) -> tuple[dict[str, StepTokens], int]:
        """Run a round through the graphs; returns the tokens and the bucket used."""
        seqs, k = rnd.seqs, rnd.num_steps
        b = len(seqs)
        bucket = self.bucket_for(b)
        st = build_sampling_tensors(seqs, self.runner.vocab_size, self.runner.eos_ids, torch.device("cpu"))
        variant = "greedy" if st.all_greedy else "sample"
        # stage everything on the host, then one copy per buffer
        table = torch.full((b, self.table_width), DUMMY_BLOCK, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        positions, slots, context_lens = plan_steps(seqs, k, table, self.runner.block_size)
        self._reset_padding(b, bucket)
        non_blocking = self.device.type == "cuda"
        for dst, src in ((self.input_ids[:b], torch.tensor([s.last_token_id for s in seqs])),
                         (self.step_positions[:k, :b], positions), (self.step_slots[:k, :b], slots),
                         (self.step_context_lens[:k, :b], context_lens), (self.block_tables[:b], table),
                         (self.temperature[:b], st.temperature), (self.top_k[:b], st.top_k), (self.top_p[:b], st.top_p),
                         (self.min_p[:b], st.min_p), (self.seeds[:b], st.seeds), (self.output_pos[:b], st.output_pos)):
            dst.copy_(src, non_blocking=non_blocking)
        self.step.zero_()
        entry = self.graphs[(bucket, variant)]
        for _ in range(k):
            if entry.graph is not None:
                entry.graph.replay()
            else:
                self.runner.decode_step(entry.state)
        state = entry.state
        state.out_tokens, state.out_logprobs = self.out_tokens[:k, :bucket], self.out_logprobs[:k, :bucket]
        results = self.runner.collect(rnd, state)
        state.out_tokens, state.out_logprobs = self.out_tokens[:, :bucket], self.out_logprobs[:, :bucket]
        return results, bucket
