"""EngineCore: the token-level engine. Owns the model, KV cache, scheduler, runner and
CUDA graphs; `step()` runs one prefill batch or one decode round and returns, per
request, the token ids it added (EOS, stop token ids and max_tokens are found here;
text, detokenization and stop strings belong to the front end).

Overlap (EngineConfig.overlap_rounds): a decode round through the graph decoder is left
in flight on the device; the next step launches the round after it (when the scheduler
can tell it without the tokens of the one in flight) before it waits for and processes
the one in flight, so the device never idles while the host works.

A batch that raises is retried one request at a time, so a request that makes the
model run fail (whatever slipped past validation) fails alone and its batch mates go on."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from graphserve.engine import gc_stats
from graphserve.engine.config import EngineConfig
from graphserve.engine.core.messages import CoreOutput
from graphserve.engine.core.speculation import SpeculativeDecoder, default_max_batch, make_drafter
from graphserve.engine.core.warm_up import warm_up
from graphserve.engine.distributed import init_tensor_parallel
from graphserve.engine.errors import InvalidConfigError, InvalidRequestError
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.cpu import paths as cpu_paths
from graphserve.engine.cpu import quant_linear
from graphserve.engine.model_files.model_path import resolve_model_path
from graphserve.engine.models.sharding import check_tensor_parallel
from graphserve.engine.request import SamplingParams, Sequence, TokenLogprob
from graphserve.engine.runner.cuda_graphs import GraphDecoder, RoundHandle, eager_reason
from graphserve.engine.runner.device_time import DeviceTimeline
from graphserve.engine.runner.model_runner import ModelRunner, StepTokens
from graphserve.engine.runner.prefill_graphs import (
    PREFILL_GRAPH_MAX_SEQS,
    PrefillGraphs,
)
from graphserve.engine.sched.kv_cache import (
    BlockManager,
    allocate_kv_cache,
    kv_bytes_per_block,
)
from graphserve.engine.sched.scheduler import DecodeRound, PrefillBatch, Scheduler
from graphserve.engine.stats import EngineStats
from graphserve.engine.structured.grammar import GrammarCompiler, StructuredOutputs
from graphserve.engine.tokenizer import Tokenizer

logger = logging.getLogger("graphserve.engine")

WAIT_POLL_S = 50e-6  # how often _serve_while_waiting looks at the round and the front ends

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, args: ModelArgs, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(args.dtype, torch.bfloat16) if args.dtype != "float32" else torch.bfloat16


def resolve_quantization(config: EngineConfig, model_path: str, device: torch.device) -> str | None:
    """The quantization asked for; left out, "gguf" for a GGUF model (the embedded default, --model
    FILE.gguf, or the folder it was converted into) on the CPU with dtype auto and one rank: the
    file's quantized blocks, as it ships them, where the quantized kernel is built. --dtype float32
    serves the dequantized weights instead (exactly transformers' tokens)."""
    if config.quantization is not None or config.dtype != "auto" or device.type != "cpu" \
            or config.tensor_parallel_size != 1:
        return config.quantization
    if not (Path(model_path) / quant_linear.GGUF_BLOCKS_FILE).is_file() or not quant_linear.available():
        return None
    logger.info("serving the GGUF file's quantized blocks (--dtype float32: its dequantized float32 weights)")
    return "gguf"


def cpu_has_native_bf16() -> bool:
    """x86: AVX512-BF16 or AMX-BF16 in /proc/cpuinfo (elsewhere: assume yes, say nothing)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags or "flags" not in flags


class EngineCore:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_init_method: str | None = None):
        """tp_rank, tp_init_method: under tensor parallelism (config.tensor_parallel_size > 1),
        this rank and the ranks' rendezvous (tcp://host:port). Every rank runs an EngineCore
        on the same requests in the same order: the scheduler's decisions are deterministic,
        and every rank samples the same tokens from the gathered logits."""
        from graphserve.engine.models.attention import make_attention_backend
        from graphserve.engine.models.loader import load_model

        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.device = resolve_device(config.device)
        tp_size = config.tensor_parallel_size
        if self.device.type == "cpu":
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
            try:
                cpu_paths.check_requested_isa()
            except ValueError as exc:
                raise InvalidConfigError(str(exc)) from None
            logger.info(cpu_paths.describe())
        else:  # the host's share of a GPU round is tiny; idle OpenMP workers would spin on the front ends' cores
            torch.set_num_threads(1)
        args = ModelArgs.from_dir(self.model_path)
        self.args = args
        check_tensor_parallel(args, tp_size, self.device)
        if tp_size > 1 and tp_init_method is None:
            raise InvalidConfigError("tensor_parallel_size > 1 needs every rank started with its rank and the "
                                     "ranks' rendezvous (tp_rank, tp_init_method)")
        if self.device.type == "cuda" and tp_size > 1:
            self.device = torch.device("cuda", tp_rank)
        self.tp = init_tensor_parallel(tp_rank, tp_size, self.device, tp_init_method or "")
        self.dtype = resolve_dtype(config.dtype, args, self.device)
        self.quantization = resolve_quantization(config, self.model_path, self.device)
        if self.device.type == "cpu" and self.dtype != torch.float32 and not cpu_has_native_bf16():
            logger.warning("%s on a CPU without native bf16/fp16 matrix instructions is emulated and several "
                           "times slower than float32 (measured 4x); prefer --dtype float32",
                           str(self.dtype).split(".")[-1])
        eos_token_id = Tokenizer(self.model_path).eos_token_id
        self.eos_ids = tuple(dict.fromkeys([*args.eos_token_ids, *([eos_token_id] if eos_token_id is not None else [])]))

        started = time.perf_counter()
        max_len_wanted = config.max_model_len or args.max_position_embeddings
        backend = make_attention_backend(self.device, config.block_size)
        self.model = load_model(self.model_path, self.dtype, self.device, backend, max_len_wanted, self.tp,
                                self.quantization, config.load_format)
        # a draft model is loaded before the KV pools are sized: its pool holds as many blocks as the target's
        draft = self._load_draft_model(backend, max_len_wanted) if config.speculative_method == "draft" else None
        num_blocks = self.tp.min_int(self._num_kv_blocks(draft))  # every rank's scheduler sees the same pool
        self.max_model_len = min(max_len_wanted, (num_blocks - 1) * config.block_size)
        self.kv_caches = allocate_kv_cache(self.model.kv_args, num_blocks, config.block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_caching,
                                          cache_salt=f"{self.model_path}:{self.dtype}")
        # on CPU a prefill step is compute-bound: the running decodes ride along for next to nothing
        self.scheduler = Scheduler(config, self.block_manager, mix_decodes=self.device.type == "cpu")
        self.runner = ModelRunner(self.model, self.kv_caches, self.block_manager, self.device, self.eos_ids)
        self.structured = StructuredOutputs(
            GrammarCompiler(self.model_path, args.vocab_size, list(self.eos_ids), config.grammar_compile_timeout),
            max_rows=config.max_num_seqs)
        self.runner.structured = self.structured
        self.speculation = None if config.speculative_method is None else SpeculativeDecoder(
            self._make_drafter(draft, num_blocks), config.num_speculative_tokens, self.runner,
            self.block_manager, self.max_model_len,
            config.speculative_max_batch if config.speculative_max_batch is not None else default_max_batch(self.device))
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            table_width = -(-self.max_model_len // config.block_size)
            self.graphs = GraphDecoder(self.runner, min(config.max_num_seqs, config.cuda_graph_max_batch),
                                       config.decode_chunk, table_width)
            self.runner.decode_table_width = table_width
            self.graphs.capture()
            if config.cuda_graph_max_prefill_tokens:
                self.runner.prefill_graphs = PrefillGraphs(
                    self.model, self.kv_caches, config.block_size, config.cuda_graph_max_prefill_tokens,
                    min(config.max_num_seqs, PREFILL_GRAPH_MAX_SEQS), table_width, self.device)
                self.runner.prefill_graphs.capture()
        if self.device.type == "cuda":
            self.runner.warm_up_eager_prefill()
        self.sequences: dict[str, Sequence] = {}
        self.reset_stats()
        self._injected_fault: str | None = None
        self._poisoned: set[str] = set()  # tests: requests whose every batch fails
        self._in_flight: RoundHandle | None = None  # a launched decode round, not collected yet
        self._rounds_completed = 0  # the rounds launched before (and with) the last one collected
        # set by the core loop (one rank): called while a round runs, with the outputs made so far
        # in the step; it sends them and takes the messages that arrived (new requests, aborts)
        self.on_wait: Callable[[list[CoreOutput]], None] | None = None
        # unseeded requests get a seed from here: the OS's entropy unless --seed fixes it (ranks of
        # one tensor-parallel engine draw the same sequence: rank 0's)
        self._seeds = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        if self.tp.size > 1 and config.seed is None:
            self._seeds = random.Random(self.tp.broadcast_int(random.SystemRandom().getrandbits(62)))
        logger.info("loaded %s (%s, %d layers) on %s in %s: %.1fs; KV pool %d blocks x %d tokens, max_model_len %d",
                    self.model_path, args.architecture, args.num_layers, self.device, str(self.dtype).split(".")[-1],
                    time.perf_counter() - started, num_blocks, config.block_size, self.max_model_len)
        # on CPU too: the grammar vocabulary, the C kernels' first calls, the front ends' first requests
        self.warmed_up = config.warm_up
        if self.warmed_up:
            warm_up(self)

    def reset_stats(self) -> None:
        """Counters and device timeline from zero (at start-up, and after the warm-up burst)."""
        self.stats_counters = EngineStats(kv_blocks_total=self.block_manager.num_usable_blocks)
        self.timeline = DeviceTimeline(self.device)
        self.scheduler.num_preemptions = self.scheduler.num_queried_tokens = self.scheduler.num_cached_tokens = 0
        self.runner.num_graph_prefills = self.runner.num_overtaking_prefills = 0

    def _load_draft_model(self, backend, max_positions: int):
        """The draft model of speculative_method "draft": the target's dtype, device, attention backend
        and quantization setting (a GGUF draft on CPU: its blocks) unless draft_quantization says
        otherwise, a vocabulary within the target's (the same tokenizer)."""
        from graphserve.engine.models.loader import load_model

        path = resolve_model_path(self.config.draft_model)
        draft_args = ModelArgs.from_dir(path)
        if draft_args.vocab_size > self.args.vocab_size:
            raise InvalidConfigError(f"the draft model {path} has a vocabulary of {draft_args.vocab_size} tokens, more "
                                     f"than the target's {self.args.vocab_size}: a draft model must share its tokenizer")
        return load_model(path, self.dtype, self.device, backend, max_positions,
                          quantization=self.config.draft_quantization
                          or resolve_quantization(self.config, path, self.device),
                          load_format=self.config.load_format)

    def _make_drafter(self, draft, num_blocks: int):
        cfg = self.config
        if draft is None:
            return make_drafter(cfg.speculative_method)
        kv = allocate_kv_cache(draft.kv_args, num_blocks, cfg.block_size, self.dtype, self.device)
        runner = ModelRunner(draft, kv, BlockManager(num_blocks, cfg.block_size, prefix_caching=False), self.device,
                             self.eos_ids)
        graphs = None
        if self.device.type == "cuda" and not cfg.enforce_eager:  # rounds of k steps, for up to max_num_seqs rows
            table_width = -(-self.max_model_len // cfg.block_size)
            runner.decode_table_width = table_width
            graphs = GraphDecoder(runner, min(cfg.max_num_seqs, cfg.cuda_graph_max_batch), cfg.num_speculative_tokens,
                                  table_width, variants=("greedy",))  # its drafts are greedy
            graphs.capture()
        return make_drafter("draft", runner, cfg.num_speculative_tokens, self.max_model_len, graphs)

    def _num_kv_blocks(self, draft=None) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_block(self.model.kv_args, cfg.block_size, self.dtype)
        if draft is not None:
            per_block += kv_bytes_per_block(draft.kv_args, cfg.block_size, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what loading freed (a draft model's too) is free for the pool
            free, total = torch.cuda.mem_get_info(self.device)
            # leave room for activations, logits and CUDA graphs
            reserve = 2 * 1024**3 + cfg.max_num_batched_tokens * self.args.vocab_size * 8
            budget = free - (1 - cfg.gpu_memory_utilization) * total - reserve
        else:
            budget = cfg.kv_cache_bytes
        max_len = cfg.max_model_len or self.args.max_position_embeddings
        # no more than every sequence at full length needs, plus the dummy block
        cap = cfg.max_num_seqs * -(-max_len // cfg.block_size) + 1
        return max(2, min(int(budget // per_block), cap))

    # ---- requests ------------------------------------------------------------------

    def make_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      seed: int | None = None) -> Sequence:
        """A sequence for a checked prompt (InputProcessor.check); the seed of an unseeded
        request is drawn here, the one place that decides it (`seed`: one rank 0 drew)."""
        n = len(prompt_token_ids)
        if params.max_tokens is None or n + params.max_tokens > self.max_model_len or n == 0:
            raise InvalidRequestError(f"request {request_id} was not checked against max_model_len")
        if seed is None:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        return Sequence(request_id, prompt_token_ids, params, seed)

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.sequences:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already running")
        self.sequences[seq.request_id] = seq
        if seq.params.grammar is not None:
            self.structured.submit(seq)  # joins the scheduler when its grammar is compiled
        else:
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt_block_keys: list[bytes] | None = None) -> Sequence:
        """prompt_block_keys: the prefix-cache keys a front end hashed (AddRequest)."""
        seq = self.make_sequence(request_id, prompt_token_ids, params)
        self.block_manager.adopt_prompt_keys(seq, prompt_block_keys)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks (no output). False if it was not running."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        self.structured.release(request_id)
        self._release_drafts(request_id)
        seq.finish_reason = "abort"
        self._drop_unwanted_round()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or bool(self.structured.compiling)

    # ---- the step ------------------------------------------------------------------

    def inject_fault(self, kind: str, request_id: str | None = None) -> None:
        """Tests only. "step": the next step's model run raises for every request in it
        (they fail, the engine goes on); "request": every batch holding `request_id` (default:
        the newest request) raises, so it fails alone and its batch mates are retried;
        "fatal": the engine's own bookkeeping raises (the engine dies)."""
        if kind == "request":
            if request_id is None and self.sequences:
                request_id = next(reversed(self.sequences))
            if request_id is not None:
                self._poisoned.add(request_id)
            return
        if kind not in ("step", "fatal"):
            raise ValueError(f"unknown fault kind {kind!r}")
        self._injected_fault = kind

    def step(self) -> list[CoreOutput]:
        """Run one scheduled batch, or (overlap) collect the decode round in flight after
        launching the next one; returns what it added to each request. Requests that make
        the model run raise fail alone (finish_reason "error", blocks freed); anything else
        propagates."""
        if self._injected_fault == "fatal":
            self._injected_fault = None
            raise RuntimeError("injected fatal engine fault")
        outputs = self._admit_compiled() if self.structured.compiling else []
        outputs += self._step()
        if not self.has_unfinished():
            self.timeline.pause()
        return outputs

    def _admit_compiled(self) -> list[CoreOutput]:
        """Requests whose grammar compiled join the scheduler; those whose grammar failed end."""
        ready, failed = self.structured.poll(wait=self.tp.size > 1)
        for seq in ready:
            if not seq.is_finished:
                self.scheduler.add(seq)
        outputs = []
        for seq, error in failed:
            logger.warning("request %s: %s", seq.request_id, error)
            outputs += self._fail_all([seq], error)
        return outputs

    def _step(self) -> list[CoreOutput]:
        if self._in_flight is None:
            batch = self.scheduler.schedule()
            if batch is None:
                self.timeline.pause()
                if self.structured.compiling:
                    time.sleep(0.0005)  # only grammars compiling: no need to spin
                return []
            if not self._overlaps(batch):
                return self._run_now(batch)
            try:
                self._in_flight = self._launch(batch)
            except Exception:
                logger.exception("launching a decode round failed; retrying its %d requests one by one",
                                 len(batch.seqs))
                return self._retry_alone(batch)
        return self._collect_in_flight()

    def _overlaps(self, batch: PrefillBatch | DecodeRound) -> bool:
        return (self.config.overlap_rounds and isinstance(batch, DecodeRound)
                and self._eager_reason(batch) is None and not self._constrained(batch)
                and not self._speculates(batch))

    def _speculates(self, rnd: DecodeRound) -> bool:
        """A round that speculates runs synchronously: its verify step's tokens are on the host
        before the next drafts are made, so no round can be launched ahead of it."""
        return self.speculation is not None and self.speculation.applies(len(rnd.seqs))

    def _constrained(self, rnd: DecodeRound) -> bool:
        """A grammar row needs its last token on the host before its next mask: without the
        graph decoder's mask feed, no round can be launched ahead of it."""
        return (self.graphs is None or not self.graphs.feeds_masks) and any(s.params.grammar is not None
                                                                           for s in rnd.seqs)

    def _run_now(self, batch: PrefillBatch | DecodeRound) -> list[CoreOutput]:
        """A batch run and processed synchronously: prefills, eager rounds, no overlap."""
        try:
            new_tokens = self._run(batch)
        except Exception:
            if len(batch.seqs) == 1:
                logger.exception("engine step failed; failing its request")
                return self._fail_all(batch.seqs)
            logger.exception("engine step failed; retrying its %d requests one by one", len(batch.seqs))
            return self._retry_alone(batch)
        return self._process(batch, new_tokens)

    def _run(self, batch: PrefillBatch | DecodeRound) -> dict[str, StepTokens]:
        self._take_step_fault(batch)
        mark = self.timeline.begin()
        try:
            if isinstance(batch, PrefillBatch):
                return self.runner.prefill(batch, overtake=self._may_overtake(batch))
            if self._speculates(batch):
                return self._decode_speculating(batch)
            return self.decode(batch)
        finally:
            self.timeline.end(mark)

    def _may_overtake(self, batch: PrefillBatch) -> bool:
        """Whether a short prefill may run ahead of the decode rounds still on the device (the
        prefill graphs' priority stream): only when one is running, and no block it writes was
        freed after the launch of one that is (that round may still write the block: a
        sequence that ended inside it). Not under tensor parallelism: the ranks' collectives
        must not run on two streams at once. Only with EngineConfig.prefill_ahead."""
        blocks = self.block_manager
        if (not self.config.prefill_ahead or self.runner.prefill_graph_bucket(batch) is None or self.tp.size > 1
                or self._rounds_completed >= blocks.rounds_launched):
            return False
        return all(blocks.last_freed(s, s.num_computed_tokens, s.num_computed_tokens + n) <= self._rounds_completed
                   for s, n in zip(batch.seqs, batch.chunk_lens))

    def _retry_alone(self, batch: PrefillBatch | DecodeRound) -> list[CoreOutput]:
        """Run each request of a failed batch on its own: the one(s) that still fail are
        failed, the others get their tokens as if nothing happened (the retry recomputes the
        same positions; sampling noise depends on (seed, position) only). Not under tensor
        parallelism: the ranks' collectives would no longer match, so the failure is fatal."""
        if self.tp.size > 1:
            raise RuntimeError("an engine step failed on a tensor-parallel rank")
        self._forget_taken()
        outputs = []
        for i, seq in enumerate(batch.seqs):
            if seq.is_finished:
                continue
            if isinstance(batch, PrefillBatch):
                alone: PrefillBatch | DecodeRound = PrefillBatch(
                    [seq], [batch.chunk_lens[i]], num_decodes=int(i >= len(batch.seqs) - batch.num_decodes))
            else:
                alone = DecodeRound([seq], batch.num_steps)
            try:
                new_tokens = self._run(alone)
            except Exception:
                logger.exception("request %s fails on its own; failing it", seq.request_id)
                outputs += self._fail_all([seq])
                continue
            outputs += self._process(alone, new_tokens)
        return outputs

    def _forget_taken(self) -> None:
        """After a failed round: the grammar rows' matchers go back to what the host appended."""
        if self.graphs is not None:
            self.graphs.drain_feed()
        self.structured.forget_taken()

    def _collect_in_flight(self) -> list[CoreOutput]:
        """While the round in flight runs: prefill what waits (queued behind it on the
        device; its first tokens come back now), and launch the round after it for the
        sequences that surely continue plus the ones just prefilled. Then wait for the
        round in flight and process its tokens. So under turnover the device keeps a
        round queued, and a new request joins the next round without draining the pipeline."""
        prev, self._in_flight = self._in_flight, None
        outputs = []
        prefill = self.scheduler.schedule_prefill()
        if prefill is not None:
            outputs += self._run_now(prefill)
        ahead = self.scheduler.schedule_decode_ahead(prev.rnd)
        if (ahead is not None and self._eager_reason(ahead) is None and not self._constrained(ahead)
                and not self._speculates(ahead)):
            try:
                self._in_flight = self._launch(ahead)
                self.stats_counters.decode_rounds_ahead += 1
            except Exception:  # prev is collected below; its requests are scheduled again after it
                if self.tp.size > 1:
                    raise
                logger.exception("launching a decode round ahead failed; it will be scheduled again")
                self._in_flight = None
        if self.on_wait is not None:
            outputs = self._serve_while_waiting(prev, outputs)
        try:
            new_tokens, _ = self.graphs.collect(prev)
            self._rounds_completed = max(self._rounds_completed, prev.number)
        except Exception:
            logger.exception("collecting a decode round failed; retrying its %d requests one by one",
                             len(prev.rnd.seqs))
            self._in_flight = None  # the round ahead continued the failed one: drop its tokens too
            return outputs + self._retry_alone(prev.rnd)
        outputs += self._process(prev.rnd, new_tokens)
        self._drop_unwanted_round()
        return outputs

    def _serve_while_waiting(self, prev: RoundHandle, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """While `prev` runs: hand the step's outputs so far to on_wait (sent, and the messages
        that arrived taken), and with EngineConfig.prefill_ahead prefill newcomers at once where
        that prefill can overtake the rounds on the device. A newcomer's first token then waits
        neither for the rest of this round nor for the round queued behind it. Returns the
        outputs not handed over."""
        if not self.config.prefill_ahead:
            # the prefill's first tokens go out now, not after the round is collected and processed
            self.on_wait(outputs)
            return []
        stuck = False  # newcomers were admitted whose prefill cannot overtake: the next step runs it
        while not self.graphs.is_done(prev):
            self.on_wait(outputs)
            outputs = []
            if self.scheduler.waiting and not stuck:
                batch = self.scheduler.schedule_prefill()
                if batch is not None and self._may_overtake(batch):
                    outputs = self._run_now(batch)
                    continue
                stuck = batch is not None
            time.sleep(WAIT_POLL_S)  # lets the core's other threads (grammar masks) run
        return outputs

    def _drop_unwanted_round(self) -> None:
        """Forget the round in flight once every request in it has ended: nobody needs its
        tokens. The device still runs it, before anything launched later (one stream), and
        the graph decoder reuses its host buffers only after its event."""
        if self._in_flight is not None and all(s.is_finished for s in self._in_flight.rnd.seqs):
            self._in_flight = None

    def _process(self, batch: PrefillBatch | DecodeRound, new_tokens: dict[str, StepTokens]) -> list[CoreOutput]:
        """Append a batch's tokens, end the sequences that are done, and make their outputs."""
        stats = self.stats_counters
        if isinstance(batch, PrefillBatch):
            stats.prefill_steps += 1
            stats.prompt_tokens += sum(batch.chunk_lens[:len(batch.chunk_lens) - batch.num_decodes])
            for seq in batch.seqs:  # requests admitted from now on can share these blocks already
                self.block_manager.register(seq)
            touched = [s for s in batch.seqs if not s.in_prefill]
        else:
            stats.decode_rounds += 1
            # a sequence that ended (stop, abort) while its round was in flight: its tokens are dropped
            touched = [s for s in batch.seqs if not s.is_finished]
        outputs = []
        for seq in touched:
            step = new_tokens.get(seq.request_id)
            first = seq.num_output_tokens == 0
            if step is not None:
                kept = self._append(seq, step)
                stats.generation_tokens += kept
                if not seq.is_finished and isinstance(batch, DecodeRound):
                    seq.num_computed_tokens = seq.num_tokens - 1
                out = CoreOutput(seq.request_id, step.tokens[:kept], finish_reason=seq.finish_reason,
                                 stop_reason=seq.stop_reason, error=seq.error, request_at_fault=seq.error is not None)
                if step.logprobs is not None:
                    out.logprobs = [TokenLogprob(t, lp, top)
                                    for t, lp, top in zip(step.tokens[:kept], step.logprobs, step.top)]
            else:
                if seq.num_output_tokens >= seq.params.max_tokens:  # max_tokens 0: prompt logprobs only
                    seq.finish_reason = "length"
                out = CoreOutput(seq.request_id, [], finish_reason=seq.finish_reason)
            if first:
                out.num_cached_tokens = seq.num_cached_tokens
                if out.token_ids:
                    now = time.monotonic()
                    out.core_times = (seq.scheduled_at or now, now)
                if seq.prompt_logprobs is not None:
                    out.prompt_logprobs = seq.prompt_logprobs
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self.sequences.pop(seq.request_id, None)
                self.structured.release(seq.request_id)
                self._release_drafts(seq.request_id)
            outputs.append(out)
        return outputs

    def _append(self, seq: Sequence, step: StepTokens) -> int:
        """Append `step.tokens` to `seq` up to its end (EOS, a stop token id, max_tokens);
        returns how many were kept."""
        params = seq.params
        eos = () if params.ignore_eos else self.eos_ids
        kept = 0
        for token in step.tokens:
            if params.grammar is not None:
                accepted, grammar_done = self.structured.accept(seq.request_id, token)
                if not accepted:
                    seq.finish_reason = "error"
                    if self.structured.allows_nothing(seq.request_id):
                        # the grammar needs bytes no token of this vocabulary spells (a character whose
                        # lead byte it lacks): the row was masked whole and the sampler fell on id 0
                        seq.error = ("the output's constraint asks for text this model's vocabulary cannot write "
                                     "(no token can continue it)")
                    else:  # the mask allowed it: only a bug gets here
                        logger.error("request %s: the grammar rejected sampled token %d", seq.request_id, token)
                    break
                if grammar_done:  # the grammar accepted an end-of-sequence token
                    seq.token_ids.append(token)
                    kept += 1
                    seq.finish_reason, seq.stop_reason = "stop", None
                    break
            seq.token_ids.append(token)
            kept += 1
            n_out = seq.num_output_tokens
            if (token in eos or token in params.stop_token_ids) and n_out > params.min_tokens:
                seq.finish_reason, seq.stop_reason = "stop", token if token not in self.eos_ids else None
                break
            if n_out >= params.max_tokens:
                seq.finish_reason = "length"
                break
        return kept

    def _take_step_fault(self, batch: PrefillBatch | DecodeRound) -> None:
        if self._injected_fault == "step":
            self._injected_fault = None
            self._poisoned.update(s.request_id for s in batch.seqs)
        if self._poisoned and any(s.request_id in self._poisoned for s in batch.seqs):
            raise RuntimeError("injected step fault")

    def _fail_all(self, seqs: list[Sequence], error: str | None = None) -> list[CoreOutput]:
        outputs = []
        for seq in seqs:
            if seq.is_finished:
                continue
            self.scheduler.finish(seq)
            self.sequences.pop(seq.request_id, None)
            self.structured.release(seq.request_id)
            self._release_drafts(seq.request_id)
            self._poisoned.discard(seq.request_id)
            seq.finish_reason = "error"
            outputs.append(CoreOutput(seq.request_id, [], finish_reason="error", error=error))
        return outputs

    def _eager_reason(self, rnd: DecodeRound) -> str | None:
        """Why `rnd` cannot go through the graph decoder, or None if it can."""
        if self.graphs is None:
            return "cpu" if self.device.type == "cpu" else "enforce_eager"
        return eager_reason(rnd.seqs, self.graphs.max_bucket)

    def _launch(self, rnd: DecodeRound) -> RoundHandle:
        self._take_step_fault(rnd)
        mark = self.timeline.begin()
        try:
            handle = self.graphs.launch(rnd)
        finally:
            self.timeline.end(mark)
            self.block_manager.rounds_launched += 1  # also a failed launch: it may have queued work
        handle.number = self.block_manager.rounds_launched
        self._count_replays(handle.bucket, rnd.num_steps)
        return handle

    def _count_replays(self, bucket: int, num_steps: int) -> None:
        stats = self.stats_counters
        # copy-on-write: stats() may read these dicts from another thread at any time
        stats.graph_replays = {**stats.graph_replays, bucket: stats.graph_replays.get(bucket, 0) + num_steps}

    def decode(self, rnd: DecodeRound) -> dict[str, StepTokens]:
        """A decode round run to the end: through the graphs when they can take it, else
        eagerly (counted by reason)."""
        reason = self._eager_reason(rnd)
        if reason is None:
            self.block_manager.rounds_launched += 1
            tokens, bucket = self.graphs.collect(self.graphs.launch(rnd))
            self._count_replays(bucket, rnd.num_steps)
        else:
            stats = self.stats_counters
            stats.eager_rounds = {**stats.eager_rounds, reason: stats.eager_rounds.get(reason, 0) + 1}
            # synchronous, on the stream of the rounds; serving on CPU, it ends early for requests that arrive
            # (a CUDA round is eager only for a reason of its own: grammar rows, enforce_eager)
            end_early = (self._newcomers_arrived(len(self.scheduler.waiting))
                         if self.on_wait is not None and self.device.type == "cpu" else None)
            tokens = self.runner.decode(rnd, end_early=end_early)
        self._rounds_completed = self.block_manager.rounds_launched  # it waited for everything before it
        return tokens

    def _newcomers_arrived(self, num_waiting: int) -> Callable[[], bool]:
        """For a round run synchronously while serving (CPU): between two of its steps, take what
        the front ends sent (on_wait); true once requests arrived that the scheduler would
        prefill now, so their first token waits for one decode step rather than the round."""
        def check() -> bool:
            self.on_wait([])
            return self.scheduler.end_round_early(num_waiting)
        return check

    def _decode_speculating(self, rnd: DecodeRound) -> dict[str, StepTokens]:
        """A decode round with speculation on: the sequences with drafts run one verify step (up to
        k + 1 tokens each), the others the round's K decode steps; _process appends both alike."""
        spec = self.speculation
        plan = spec.plan(rnd.seqs, spec.max_verify(self.graphs), on_device=self.graphs is not None)
        tokens = self.decode(DecodeRound(plan.decode_seqs, rnd.num_steps)) if plan.decode_seqs else {}
        if plan.verify_seqs:
            verified = spec.verify(plan.verify_seqs, plan.drafts, self.graphs, plan.device_tokens)
            stats = self.stats_counters
            stats.spec_verify_rows += len(plan.verify_seqs)
            stats.spec_draft_tokens += verified.num_draft_tokens
            stats.spec_accepted_tokens += verified.num_accepted_tokens
            tokens.update(verified.tokens)
        return tokens

    def _release_drafts(self, request_id: str) -> None:
        if self.speculation is not None:
            self.speculation.release(request_id)

    def stats(self) -> EngineStats:
        """A snapshot; safe to call from another thread."""
        self.timeline.poll()
        gc_collections, gc_seconds = gc_stats.totals()
        # the counter dicts are replaced, never mutated, so sharing them is safe
        return dataclasses.replace(self.stats_counters, num_running=len(self.scheduler.running),
                                   num_waiting=len(self.scheduler.waiting),
                                   kv_blocks_free=self.block_manager.num_free_blocks,
                                   num_preemptions=self.scheduler.num_preemptions,
                                   grammar_requests=self.structured.num_requests,
                                   kv_blocks_cached_free=self.block_manager.num_cached_free_blocks,
                                   prefix_cache_queries=self.scheduler.num_queried_tokens,
                                   prefix_cache_hits=self.scheduler.num_cached_tokens,
                                   prefill_graph_steps=self.runner.num_graph_prefills,
                                   prefill_steps_ahead=self.runner.num_overtaking_prefills,
                                   device_busy_seconds=self.timeline.busy_seconds,
                                   device_idle_seconds=self.timeline.idle_seconds,
                                   gc_full_collections=gc_collections, gc_full_collection_seconds=gc_seconds)
