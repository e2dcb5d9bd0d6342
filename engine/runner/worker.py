"""Worker: one rank's device state, built whole before the engine's loop starts, and the rounds it runs.

The constructor decides the device, dtype and quantization and joins the tensor-parallel group
(device_setup.py), loads the model and the draft model of speculative_method "draft"
(model_loading.py), sizes and allocates the KV pools of its KV cache groups (KVGroups), builds the ModelRunner
with everything it reads, captures the decode and prefill CUDA graphs (and the draft model's) and,
on CUDA, runs the eager prefill and the sampler once so that their kernels compile now (as vLLM's
Worker and GPUModelRunner own them). Afterwards it runs what the engine core scheduled on the
device: a decode round through the graphs (launched, then collected) or eagerly, counting which."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from graphserve.engine.config import EngineConfig
from graphserve.engine.lora.host_cache import AdapterCache
from graphserve.engine.model_files.model_path import resolve_model_path
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.models.lora_layout import lora_layout
from graphserve.engine.request import Sequence
from graphserve.engine.runner import device_setup, model_loading
from graphserve.engine.runner.cuda_graphs import GraphDecoder, eager_reason
from graphserve.engine.runner.host_slots import RoundHandle
from graphserve.engine.runner.device_time import DeviceTimeline
from graphserve.engine.runner.lora_slots import LoraSlots
from graphserve.engine.runner.model_runner import ModelRunner, StepTokens
from graphserve.engine.runner.prefill_graphs import PREFILL_GRAPH_MAX_SEQS, PrefillGraphs
from graphserve.engine.sched.kv_cache import BlockManager, allocate_kv_cache, windowed_hold
from graphserve.engine.sched.kv_groups import KVGroups, KVLayout, allocate_group_kv_cache
from graphserve.engine.sched.scheduler import DecodeRound, PrefillBatch
from graphserve.engine.structured.grammar import GrammarCompiler
from graphserve.engine.structured.matchers import StructuredOutputs

logger = logging.getLogger("graphserve.engine")


class Worker:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_init_method: str | None = None):
        """tp_rank, tp_init_method: under tensor parallelism (config.tensor_parallel_size > 1),
        this rank and the ranks' rendezvous (tcp://host:port)."""
        self.config = config
        self.model_path = resolve_model_path(config.model)
        device = device_setup.resolve_device(config.device)
        device_setup.set_up_host(config, device)
        args = ModelArgs.from_dir(self.model_path)
        self.args = args
        self.device, self.tp = device_setup.join_tensor_parallel(config, args, device, tp_rank, tp_init_method)
        self.dtype = device_setup.resolve_dtype(config.dtype, args, self.device)
        self.quantization = device_setup.resolve_quantization(config, self.model_path, self.device)
        device_setup.warn_if_emulated(self.dtype, self.device)
        self.eos_ids = model_loading.stop_token_ids(self.model_path, args)

        started = time.perf_counter()
        max_len_wanted = config.max_model_len or args.max_position_embeddings
        self.model, draft = model_loading.load_models(config, self.model_path, args, self.dtype, self.device, self.tp,
                                                      self.quantization, max_len_wanted)
        # the LoRA slots before the KV pool, which takes what memory is left
        self.loras = self._lora_slots(config, args) if config.enable_lora else None
        # the KV cache groups: the layers by window, each group's pool dropping the blocks its window has
        # left (a draft model reads the target's group 0 table with its own layers: then one group keeps them)
        layout = KVLayout.of(args.layer_windows) if draft is None else KVLayout.single(args.num_layers)
        num_blocks = self.tp.min_int(device_setup.num_kv_blocks(  # every rank's scheduler sees the same pool
            config, args, self.model.kv_args, self.dtype, self.device, draft.kv_args if draft is not None else None,
            layout))  # group 0's pool; a windowed group after it holds what its window bounds (KVLayout.pool_blocks)
        self.block_manager = KVGroups.build(layout, num_blocks, config, cache_salt=f"{self.model_path}:{self.dtype}")
        self.max_model_len = min(max_len_wanted, (num_blocks - 1) * config.block_size)
        if all(p.window is not None and windowed_hold(p.window, config) <= p.num_usable_blocks
               for p in self.block_manager.pools):
            self.max_model_len = max_len_wanted  # a sequence of any length holds at most that many blocks
        self.kv_caches = allocate_group_kv_cache(self.model.kv_args, layout, [p.num_blocks for p in self.block_manager.pools],
                                                 config.block_size, self.dtype, self.device)
        self.structured = StructuredOutputs(
            GrammarCompiler(self.model_path, args.vocab_size, list(self.eos_ids), config.grammar_compile_timeout),
            max_rows=config.max_num_seqs)
        with_graphs = self.device.type == "cuda" and not config.enforce_eager
        # the decode graphs' block-table width, which eager rounds then take too (ModelRunner)
        table_width = -(-self.max_model_len // config.block_size) if with_graphs else None
        prefill_graphs = PrefillGraphs(
            self.model, self.kv_caches, config.block_size, config.cuda_graph_max_prefill_tokens,
            min(config.max_num_seqs, PREFILL_GRAPH_MAX_SEQS), table_width, self.device,
            layer_groups=layout.layer_groups if layout.num_groups > 1 else (),
        ) if with_graphs and config.cuda_graph_max_prefill_tokens else None
        self.runner = ModelRunner(self.model, self.kv_caches, self.block_manager, self.device, self.eos_ids,
                                  structured=self.structured, prefill_graphs=prefill_graphs,
                                  decode_table_width=table_width, lora=self.loras is not None)
        # the draft model's KV pool, runner and graphs come before the target's graphs are captured
        self.draft_runner, self.draft_graphs = self._draft_runner(draft, num_blocks) if draft else (None, None)
        self.graphs = None
        if with_graphs:
            self.graphs = GraphDecoder(self.runner, min(config.max_num_seqs, config.cuda_graph_max_batch),
                                       config.decode_chunk, table_width)
            self.graphs.capture()
            if prefill_graphs is not None:
                prefill_graphs.capture()
        if self.device.type == "cuda":
            self.runner.warm_up_eager_prefill()
        self.reset_counters()
        logger.info("loaded %s (%s, %d layers) on %s in %s: %.1fs; KV pool %d blocks x %d tokens, max_model_len %d",
                    self.model_path, args.architecture, args.num_layers, self.device, str(self.dtype).split(".")[-1],
                    time.perf_counter() - started, num_blocks, config.block_size, self.max_model_len)
        if layout.num_groups > 1:
            logger.info("KV cache groups (windows %s): %s blocks", ", ".join(str(w or "none") for w in layout.windows),
                        " + ".join(str(p.num_blocks) for p in self.block_manager.pools))

    def _lora_slots(self, config: EngineConfig, args: ModelArgs) -> LoraSlots:
        """The LoRA adapters' device slots (max_loras) and host cache (max_cpu_loras), in the model's dtype."""
        layout = lora_layout(args)
        cache = AdapterCache(layout, config.max_lora_rank, self.dtype, config.max_cpu_loras or config.max_loras,
                             pin_memory=self.device.type == "cuda")
        slots = LoraSlots(self.model, layout, cache, config.max_loras, config.max_lora_rank, self.dtype, self.device)
        logger.info("LoRA: %d adapter slots of rank up to %d (%.1f MiB), %d cached on the host", config.max_loras,
                    config.max_lora_rank, slots.bytes / 2**20, cache.capacity)
        return slots

    def activate_loras(self, seqs: list[Sequence], running: list[Sequence]) -> None:
        """Before a step: its sequences' LoRA adapters in device slots (engine/runner/lora_slots.py)."""
        if self.loras is not None:
            self.loras.activate(seqs, running)

    def _draft_runner(self, draft, num_blocks: int) -> tuple[ModelRunner, GraphDecoder | None]:
        """The draft model's own KV pool (as many blocks as the target's) and runner, and on CUDA its
        greedy decode graphs for rounds of k steps, for up to max_num_seqs rows."""
        cfg = self.config
        kv = allocate_kv_cache(draft.kv_args, num_blocks, cfg.block_size, self.dtype, self.device)
        with_graphs = self.device.type == "cuda" and not cfg.enforce_eager
        table_width = -(-self.max_model_len // cfg.block_size) if with_graphs else None
        runner = ModelRunner(draft, kv, BlockManager(num_blocks, cfg.block_size, prefix_caching=False), self.device,
                             self.eos_ids, decode_table_width=table_width)
        graphs = None
        if with_graphs:
            graphs = GraphDecoder(runner, min(cfg.max_num_seqs, cfg.cuda_graph_max_batch), cfg.num_speculative_tokens,
                                  table_width, variants=("greedy",))  # its drafts are greedy
            graphs.capture()
        return runner, graphs

    # ---- running what the engine core scheduled ----------------------------------------

    def reset_counters(self) -> None:
        """The device's counters and timeline from zero (at start-up, and after the warm-up burst)."""
        self.timeline = DeviceTimeline(self.device)
        # copy-on-write: the engine's stats() may read these dicts from another thread at any time
        self.graph_replays: dict[int, int] = {}  # decode steps replayed, by batch bucket
        self.eager_rounds: dict[str, int] = {}  # decode rounds run eagerly, by reason
        self.runner.num_graph_prefills = self.runner.num_overtaking_prefills = 0

    def counters(self) -> dict:
        """The device's counters, as EngineStats fields; safe to call from another thread."""
        self.timeline.poll()
        return dict(graph_replays=self.graph_replays, eager_rounds=self.eager_rounds,
                    prefill_graph_steps=self.runner.num_graph_prefills,
                    prefill_steps_ahead=self.runner.num_overtaking_prefills,
                    device_busy_seconds=self.timeline.busy_seconds, device_idle_seconds=self.timeline.idle_seconds)

    def eager_reason(self, rnd: DecodeRound) -> str | None:
        """Why `rnd` cannot go through the graph decoder, or None if it can."""
        if self.graphs is None:
            return "cpu" if self.device.type == "cpu" else "enforce_eager"
        return eager_reason(rnd.seqs, self.graphs.max_bucket)

    def launches_ahead(self, rnd: DecodeRound) -> bool:
        """Whether `rnd` can be launched before the round in flight is read: through the graphs,
        and a grammar row's masks fed while it runs (without the graph decoder's mask feed, a
        grammar row needs its last token on the host before its next mask)."""
        if self.eager_reason(rnd) is not None:
            return False
        return self.graphs.feeds_masks or not any(s.params.grammar is not None for s in rnd.seqs)

    def may_overtake(self, batch: PrefillBatch, rounds_completed: int) -> bool:
        """Whether a short prefill may run ahead of the decode rounds still on the device (the
        prefill graphs' priority stream): only when one is running (`rounds_completed`: the rounds
        launched before, and with, the last one collected), and no block it writes was
        freed after the launch of one that is (that round may still write the block: a
        sequence that ended inside it). Not under tensor parallelism: the ranks' collectives
        must not run on two streams at once. Only with EngineConfig.prefill_ahead."""
        blocks = self.block_manager
        if (not self.config.prefill_ahead or self.runner.prefill_graph_bucket(batch) is None or self.tp.size > 1
                or self.loras is not None or rounds_completed >= blocks.rounds_launched):
            return False
        return all(blocks.last_freed(s, s.num_computed_tokens, s.num_computed_tokens + n) <= rounds_completed
                   for s, n in zip(batch.seqs, batch.chunk_lens))

    def forget_taken(self) -> None:
        """After a failed round: the grammar rows' matchers go back to what the host appended."""
        if self.graphs is not None:
            self.graphs.drain_feed()
        self.structured.forget_taken()

    def launch(self, rnd: DecodeRound) -> RoundHandle:
        """Launch a round through the graphs, not waiting for it (collect() reads it)."""
        try:
            handle = self.graphs.launch(rnd)
        finally:
            self.block_manager.rounds_launched += 1  # also a failed launch: it may have queued work
        handle.number = self.block_manager.rounds_launched
        self._count_replays(handle.bucket, rnd.num_steps)
        return handle

    def is_done(self, handle: RoundHandle) -> bool:
        """Whether a launched round's tokens have reached the host (collect would not wait)."""
        return self.graphs.is_done(handle)

    def collect(self, handle: RoundHandle) -> dict[str, StepTokens]:
        """Wait for a launched round and read its tokens."""
        return self.graphs.collect(handle)[0]

    def _count_replays(self, bucket: int, num_steps: int) -> None:
        self.graph_replays = {**self.graph_replays, bucket: self.graph_replays.get(bucket, 0) + num_steps}

    def decode(self, rnd: DecodeRound, end_early: Callable[[], bool] | None = None) -> dict[str, StepTokens]:
        """A decode round run to the end: through the graphs when they can take it, else eagerly
        (counted by reason), ending early where `end_early` says so between two of its steps."""
        reason = self.eager_reason(rnd)
        if reason is None:
            self.block_manager.rounds_launched += 1
            tokens, bucket = self.graphs.collect(self.graphs.launch(rnd))
            self._count_replays(bucket, rnd.num_steps)
            return tokens
        self.eager_rounds = {**self.eager_rounds, reason: self.eager_rounds.get(reason, 0) + 1}
        # synchronous, on the stream of the rounds
        return self.runner.decode(rnd, end_early=end_early)
