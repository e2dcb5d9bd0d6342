"""CUDA graphs for short prefills: the forward pass of a packed batch of up to `max_tokens`
query tokens and the logits of each sequence's last token, one graph per token bucket,
replayed over static buffers.

Why: an eager prefill costs the host ~0.7 ms of launches per decoder layer (19 ms for
Qwen2.5-0.5B on an H200), while a prefix-cache hit leaves the device well under a
millisecond of work. Long chunks stay eager: their device time hides the launches.

A batch of T tokens in S sequences takes the smallest bucket of T_b >= T tokens, which holds
min(T_b, max_seqs) sequences. Padding: tokens past T feed token 0 at position 0 and write
their K/V into the dummy block; sequences past S have no queries and no context; attention
runs over a tile map of fixed size whose padded tiles do nothing (kernels/prefill_attention.py).
Padded rows carry garbage that no real row reads: every op is row-wise except attention,
which reads only the real sequences' blocks.

A replay may overtake the decode rounds queued on the device: the runner then runs it and its
sampling on `stream`, a stream of higher priority, when the engine has checked that no round
still running writes a block it writes (Worker.may_overtake). A prefix-cache hit's first
token then waits for a millisecond of prefill instead of a whole decode round.

On CPU (tests) the same static-buffer path runs eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from graphserve.engine import gc_stats
from graphserve.engine.models.attention import AttentionMetadata
from graphserve.engine.sched.kv_cache import DUMMY_BLOCK
from graphserve.engine.models.llama import LlamaModel
from graphserve.engine.runner.host_slots import group_buffer_name
from graphserve.engine.runner.prefill_inputs import PrefillInputs

logger = logging.getLogger("graphserve.engine")

PREFILL_GRAPH_MAX_SEQS = 64  # sequences a prefill graph holds (each adds a row of logits)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets: 16, 32, 64, ... up to max_tokens (rounded up to a power of two); none for 0."""
    if max_tokens <= 0:
        return []
    buckets = [16]
    while buckets[-1] < max_tokens:
        buckets.append(buckets[-1] * 2)
    return buckets


class PrefillGraphs:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_tokens: int, max_seqs: int, table_width: int, device: torch.device,
                 use_cuda_graphs: bool = True, layer_groups: tuple[int, ...] = ()):
        """layer_groups: each layer's KV cache group, when there are several (engine/sched/kv_groups.py);
        each group after the first has static slots and block tables of its own (slots<g>, block_tables<g>)."""
        self.model = model
        self.layer_groups = layer_groups
        self.num_groups = max(layer_groups, default=0) + 1
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = prefill_buckets(max_tokens)
        self.max_seqs = max_seqs
        self.device = device
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        from graphserve.kernels.prefill_attention import default_prefill_tile

        # the query rows of the attention kernel's tiles: what the tile map is built for
        self.tile_rows = default_prefill_tile(model.args.head_dim, model.lm_head_weight.dtype).block_m
        tokens, seqs = self.buckets[-1], self.seqs_for(self.buckets[-1])
        tiles = self.tiles_for(tokens)
        shapes = {"input_ids": ((tokens,), torch.int64), "positions": ((tokens,), torch.int64),
                  "slots": ((tokens,), torch.int64), "cu_seqlens": ((seqs + 1,), torch.int32),
                  "context_lens": ((seqs,), torch.int32), "last_rows": ((seqs,), torch.int64),
                  "tiles": ((2 * tiles,), torch.int32), "block_tables": ((seqs * table_width,), torch.int32)}
        for g in range(1, self.num_groups):
            for name in ("slots", "block_tables"):
                shapes[group_buffer_name(name, g)] = shapes[name]
        pin = device.type == "cuda"
        self.static = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}
        self.host = {name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in shapes.items()}
        self.table_width = table_width
        for g in range(self.num_groups):
            name = group_buffer_name("block_tables", g)
            self.static[name] = self.static[name].view(seqs, table_width)
        self.logits = torch.zeros(seqs, model.args.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # where an overtaking prefill runs (-1: above the default priority 0 of the decode rounds' stream)
        self.stream = torch.cuda.Stream(device, priority=-1) if self.use_cuda_graphs else None
        self.pool = None
        self.capture_seconds = 0.0
        self._staged: torch.cuda.Event | None = None  # after the last run's host-to-device copies

    def seqs_for(self, bucket: int) -> int:
        return min(bucket, self.max_seqs)

    def tiles_for(self, bucket: int) -> int:
        """Attention tiles a bucket's tile map holds: each sequence adds at most one partial tile."""
        return -(-bucket // self.tile_rows) + self.seqs_for(bucket)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int | None:
        """The smallest bucket that holds a batch of this many tokens and sequences, or None."""
        return next((b for b in self.buckets if b >= num_tokens and self.seqs_for(b) >= num_seqs), None)

    def _meta(self, bucket: int, inputs: PrefillInputs | None = None) -> AttentionMetadata:
        """The bucket's attention metadata over the static buffers (`inputs`: the host lengths
        the CPU backend loops over, real sequences only)."""
        s, n = self.seqs_for(bucket), self.tiles_for(bucket)
        st = self.static
        return AttentionMetadata(
            is_prefill=True, slot_mapping=st["slots"][:bucket], block_tables=st["block_tables"][:s],
            context_lens=st["context_lens"][:s], cu_seqlens_q=st["cu_seqlens"][:s + 1], max_seqlen_q=bucket,
            attention_tiles=st["tiles"][:2 * n].view(2, n),
            query_lens_host=None if inputs is None else inputs.query_lens.tolist(),
            context_lens_host=None if inputs is None else inputs.context_lens.tolist(),
        ).with_groups(self.layer_groups, [(st[group_buffer_name("slots", g)][:bucket],
                                           st[group_buffer_name("block_tables", g)][:s])
                                          for g in range(1, self.num_groups)])

    def _forward(self, bucket: int, meta: AttentionMetadata) -> None:
        st, s = self.static, self.seqs_for(bucket)
        hidden = self.model(st["input_ids"][:bucket], st["positions"][:bucket], meta, self.kv_caches)
        self.logits[:s].copy_(self.model.compute_logits(hidden.index_select(0, st["last_rows"][:s])))

    def _reset(self) -> None:
        """Every buffer inert: no tokens, no sequences, no tiles."""
        for name, tensor in self.static.items():
            tensor.fill_(-1 if name == "tiles" else DUMMY_BLOCK * self.block_size if name.startswith("slots") else 0)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """One graph per bucket, largest first, into one memory pool of their own."""
        self._reset()
        if not self.use_cuda_graphs:
            return
        from tqdm import tqdm

        torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        # Captured on the stream they overtake on: torch keys cuBLAS's workspace by stream, and a
        # graph bakes in the workspace of the stream it was captured on. On the default capture
        # stream they would share the decode graphs' workspace, and a replay running beside a
        # decode round would corrupt the GEMMs of both (pytorch/pytorch#193402 describes the sharing).
        capture_stream = self.stream
        with gc_stats.paused():
            for bucket in tqdm(list(reversed(self.buckets)), desc="capturing prefill graphs", disable=not progress):
                meta = self._meta(bucket)
                capture_stream.wait_stream(torch.cuda.current_stream())
                # warm-up outside the graph (Triton compiles, allocator settles)
                with torch.cuda.stream(capture_stream):
                    self._forward(bucket, meta)
                torch.cuda.current_stream().wait_stream(capture_stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=capture_stream):
                    self._forward(bucket, meta)
                self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - started
        logger.info("captured %d prefill CUDA graphs (up to %d tokens) in %.1fs", len(self.graphs),
                    self.buckets[-1], self.capture_seconds)

    def _stage(self, name: str, values: np.ndarray, fill: int, size: int) -> None:
        """values, padded with `fill` to `size`, into the static buffer `name` (through pinned memory)."""
        host = self.host[name][:size]
        host.fill_(fill)
        host[:len(values)] = torch.from_numpy(values)
        self.static[name].view(-1)[:size].copy_(host, non_blocking=self.device.type == "cuda")

    @torch.inference_mode()
    def run(self, inputs: PrefillInputs, bucket: int) -> torch.Tensor:
        """The forward pass of `inputs` in `bucket`; returns the logits of each sequence's last
        token, [B, V] float32, a view valid until the next run."""
        if self._staged is not None:  # the pinned buffers are the last run's copy sources
            self._staged.synchronize()
        b, s, n = len(inputs.query_lens), self.seqs_for(bucket), self.tiles_for(bucket)
        self._stage("input_ids", inputs.input_ids, 0, bucket)
        self._stage("positions", inputs.positions, 0, bucket)
        groups = [(inputs.slots, inputs.block_tables), *inputs.group_tables]  # each KV cache group's
        for g, (slots, _) in enumerate(groups):
            self._stage(group_buffer_name("slots", g), slots, DUMMY_BLOCK * self.block_size, bucket)
        self._stage("cu_seqlens", inputs.cu_seqlens, inputs.num_tokens, s + 1)
        self._stage("context_lens", inputs.context_lens, 0, s)
        self._stage("last_rows", inputs.last_rows, 0, s)
        from graphserve.kernels.prefill_attention import prefill_tile_map

        self._stage("tiles", prefill_tile_map(inputs.query_lens, self.tile_rows, n).reshape(-1), -1, 2 * n)
        for g, (_, group_tables) in enumerate(groups):
            name, width = group_buffer_name("block_tables", g), group_tables.shape[1]
            tables = self.host[name][:b * width].view(b, width)
            tables.copy_(torch.from_numpy(group_tables))
            self.static[name][:b, :width].copy_(tables, non_blocking=self.device.type == "cuda")
        if self.use_cuda_graphs:
            self._staged = torch.cuda.Event()
            self._staged.record()
            self.graphs[bucket].replay()
        else:
            self._forward(bucket, self._meta(bucket, inputs))
        return self.logits[:b]
