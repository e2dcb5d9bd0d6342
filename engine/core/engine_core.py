"""EngineCore: one rank's token-level engine, the request lifecycle and the step loop.

Its Worker (engine/runner/worker.py) holds the device state (model, KV pool, runner, CUDA graphs),
built whole before the first step; TokenAppender (token_appender.py) appends what a step made.
`step()` runs one prefill batch or one decode round and returns, per
request, the token ids it added (EOS, stop token ids and max_tokens are found here; text,
detokenization and stop strings belong to the front end).

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

from graphserve.engine import gc_stats
from graphserve.engine.config import EngineConfig
from graphserve.engine.core.fault_injection import FaultInjector
from graphserve.engine.core.messages import CoreOutput
from graphserve.engine.core.token_appender import TokenAppender
from graphserve.engine.core.warm_up import warm_up
from graphserve.engine.errors import AdapterError, InvalidRequestError
from graphserve.engine.request import LoraRequest, SamplingParams, Sequence
from graphserve.engine.runner.worker import RoundHandle, StepTokens, Worker
from graphserve.engine.sched.scheduler import DecodeRound, PrefillBatch, Scheduler
from graphserve.engine.spec.factory import build_speculation
from graphserve.engine.stats import EngineStats

logger = logging.getLogger("graphserve.engine")

WAIT_POLL_S = 50e-6  # how often _serve_while_waiting looks at the round and the front ends


class EngineCore:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_init_method: str | None = None):
        """tp_rank, tp_init_method: under tensor parallelism (config.tensor_parallel_size > 1),
        this rank and the ranks' rendezvous (tcp://host:port). Every rank runs an EngineCore
        on the same requests in the same order: the scheduler's decisions are deterministic,
        and every rank samples the same tokens from the gathered logits."""
        self.config = config
        self.worker = worker = Worker(config, tp_rank, tp_init_method)
        # what the step loop shares with the worker
        self.model_path, self.args, self.device, self.tp = worker.model_path, worker.args, worker.device, worker.tp
        self.eos_ids, self.max_model_len = worker.eos_ids, worker.max_model_len
        self.block_manager, self.structured = worker.block_manager, worker.structured
        # on CPU a prefill step is compute-bound: the running decodes ride along for next to nothing
        self.scheduler = Scheduler(config, self.block_manager, mix_decodes=self.device.type == "cpu")
        self.speculation = build_speculation(config, worker)
        self.sequences: dict[str, Sequence] = {}
        self._lora_loading: list[Sequence] = []  # requests waiting for their adapter to be read from disk
        self._lora_info: tuple[list[str], list[str], float] = ([], [], time.time())  # _lora_stats
        self.appender = TokenAppender(self.sequences, self.scheduler, self.block_manager, self.structured,
                                      self.speculation, self.eos_ids)
        self.reset_stats()
        self._faults = FaultInjector()  # tests only
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
        # on CPU too: the grammar vocabulary, the C kernels' first calls, the front ends' first requests
        self.warmed_up = config.warm_up
        if self.warmed_up:
            warm_up(self)

    def reset_stats(self) -> None:
        """Counters and device timeline from zero (at start-up, and after the warm-up burst)."""
        self.stats_counters = EngineStats(kv_blocks_total=self.block_manager.num_usable_blocks,
                                          kv_context_blocks=self.block_manager.num_context_blocks)
        self.scheduler.num_preemptions = self.scheduler.num_queried_tokens = self.scheduler.num_cached_tokens = 0
        self.worker.reset_counters()

    # ---- requests ------------------------------------------------------------------

    def make_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      seed: int | None = None, lora: LoraRequest | None = None) -> Sequence:
        """A sequence for a checked prompt and params (InputProcessor.check fitted max_tokens;
        trusted here); the seed of an unseeded request is drawn here, the one place that decides
        it (`seed`: one rank 0 drew). lora: the adapter it runs with (LoRA must be on)."""
        if lora is not None and self.worker.loras is None:
            raise InvalidRequestError(f"model {lora.name!r} is a LoRA adapter, and LoRA is off (--enable-lora)",
                                      param="model")
        if seed is None:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        return Sequence(request_id, prompt_token_ids, params, seed, lora=lora)

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.sequences:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already running")
        self.sequences[seq.request_id] = seq
        if seq.lora is not None and seq.lora.lora_id not in self.worker.loras.cache:
            self.worker.loras.cache.start(seq.lora)  # read on the cache's thread; the request waits for it
            self._lora_loading.append(seq)
            return
        self._enter(seq)

    def _enter(self, seq: Sequence) -> None:
        if seq.params.grammar is not None:
            self.structured.submit(seq)  # joins the scheduler when its grammar is compiled
        else:
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt_block_keys: list[bytes] | None = None, lora: LoraRequest | None = None) -> Sequence:
        """prompt_block_keys: the prefix-cache keys a front end hashed (AddRequest), under the adapter's
        root when `lora` is given."""
        seq = self.make_sequence(request_id, prompt_token_ids, params, lora=lora)
        self.block_manager.adopt_prompt_keys(seq, prompt_block_keys)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks (no output). False if it was not running."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return False
        self.appender.finish(seq)
        seq.finish_reason = "abort"
        self._drop_unwanted_round()
        return True

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or self._in_flight is not None or bool(self.structured.compiling)
                or bool(self._lora_loading))

    # ---- the step ------------------------------------------------------------------

    def inject_fault(self, kind: str, request_id: str | None = None) -> None:
        """Tests only (FaultInjector.inject); "request" without an id: the newest request."""
        self._faults.inject(kind, request_id, self.sequences)

    def step(self) -> list[CoreOutput]:
        """Run one scheduled batch, or (overlap) collect the decode round in flight after
        launching the next one; returns what it added to each request. Requests that make
        the model run raise fail alone (finish_reason "error", blocks freed); anything else
        propagates."""
        self._faults.take_fatal()
        outputs = self._admit_loaded() if self._lora_loading else []
        outputs += self._admit_compiled() if self.structured.compiling else []
        outputs += self._step()
        if not self.has_unfinished():
            self.worker.timeline.pause()
        return outputs

    def _admit_loaded(self) -> list[CoreOutput]:
        """Requests whose LoRA adapter is read go on (to their grammar or the scheduler); those whose
        adapter could not be read end with the reason."""
        cache, outputs, waiting = self.worker.loras.cache, [], []
        live = {s.lora.lora_id for s in self.sequences.values() if s.lora is not None}
        for seq in self._lora_loading:
            if seq.is_finished:  # aborted while its adapter was read
                continue
            try:
                ready = cache.ready(seq.lora, live)
            except AdapterError as exc:
                logger.warning("request %s: %s", seq.request_id, exc)
                outputs += self._fail([seq], str(exc))
                continue
            except Exception as exc:  # an adapter that passed the front end's checks and then failed to read
                logger.exception("request %s: reading LoRA adapter %s failed", seq.request_id, seq.lora.path)
                outputs += self._fail([seq], f"LoRA adapter {seq.lora.name!r} could not be read: {exc}")
                continue
            if ready:
                self._enter(seq)
            else:
                waiting.append(seq)
        self._lora_loading = waiting
        if waiting and not self.scheduler.has_work() and self._in_flight is None:
            time.sleep(0.0005)  # only adapters loading: no need to spin
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
            outputs += self._fail([seq], error)
        return outputs

    def _step(self) -> list[CoreOutput]:
        if self._in_flight is None:
            batch = self.scheduler.schedule()
            if batch is None:
                self.worker.timeline.pause()
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
        return self.config.overlap_rounds and isinstance(batch, DecodeRound) and self._launches_ahead(batch)

    def _launches_ahead(self, rnd: DecodeRound) -> bool:
        """Whether a round may be launched before the one in flight is read (Worker.launches_ahead),
        unless it speculates: its verify step's tokens must be on the host before the next drafts."""
        return self.worker.launches_ahead(rnd) and not self._speculates(rnd)

    def _speculates(self, rnd: DecodeRound) -> bool:
        return self.speculation is not None and self.speculation.applies(len(rnd.seqs))

    def _run_now(self, batch: PrefillBatch | DecodeRound) -> list[CoreOutput]:
        """A batch run and processed synchronously: prefills, eager rounds, no overlap."""
        try:
            new_tokens = self._run(batch)
        except Exception:
            if len(batch.seqs) == 1:
                logger.exception("engine step failed; failing its request")
                return self._fail(batch.seqs)
            logger.exception("engine step failed; retrying its %d requests one by one", len(batch.seqs))
            return self._retry_alone(batch)
        return self.appender.process(batch, new_tokens, self.stats_counters)

    def _run(self, batch: PrefillBatch | DecodeRound) -> dict[str, StepTokens]:
        self._faults.check_step(batch.seqs)
        self.worker.activate_loras(batch.seqs, self.scheduler.running)
        with self.worker.timeline.busy():
            if isinstance(batch, PrefillBatch):
                return self.worker.runner.prefill(batch, overtake=self._may_overtake(batch))
            if self._speculates(batch):
                return self._decode_speculating(batch)
            return self.decode(batch)

    def _may_overtake(self, batch: PrefillBatch) -> bool:
        return self.worker.may_overtake(batch, self._rounds_completed)

    def _retry_alone(self, batch: PrefillBatch | DecodeRound) -> list[CoreOutput]:
        """Run each request of a failed batch on its own: the one(s) that still fail are
        failed, the others get their tokens as if nothing happened (the retry recomputes the
        same positions; sampling noise depends on (seed, position) only). Not under tensor
        parallelism: the ranks' collectives would no longer match, so the failure is fatal."""
        if self.tp.size > 1:
            raise RuntimeError("an engine step failed on a tensor-parallel rank")
        self.worker.forget_taken()
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
                outputs += self._fail([seq])
                continue
            outputs += self.appender.process(alone, new_tokens, self.stats_counters)
        return outputs

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
        if ahead is not None and self._launches_ahead(ahead):
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
            new_tokens = self.worker.collect(prev)
            self._rounds_completed = max(self._rounds_completed, prev.number)
        except Exception:
            logger.exception("collecting a decode round failed; retrying its %d requests one by one",
                             len(prev.rnd.seqs))
            self._in_flight = None  # the round ahead continued the failed one: drop its tokens too
            return outputs + self._retry_alone(prev.rnd)
        outputs += self.appender.process(prev.rnd, new_tokens, self.stats_counters)
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
        while not self.worker.is_done(prev):
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

    def _fail(self, seqs: list[Sequence], error: str | None = None) -> list[CoreOutput]:
        return self.appender.fail(seqs, error, on_fail=self._faults.forget)

    def _launch(self, rnd: DecodeRound) -> RoundHandle:
        self._faults.check_step(rnd.seqs)
        self.worker.activate_loras(rnd.seqs, self.scheduler.running)
        with self.worker.timeline.busy():
            return self.worker.launch(rnd)

    def decode(self, rnd: DecodeRound) -> dict[str, StepTokens]:
        """A decode round run to the end: through the graphs when they can take it, else eagerly.
        Serving on CPU, an eager round ends early for requests that arrive (a CUDA round is eager
        only for a reason of its own: grammar rows, enforce_eager)."""
        end_early = (self._newcomers_arrived(len(self.scheduler.waiting))
                     if self.on_wait is not None and self.device.type == "cpu" else None)
        tokens = self.worker.decode(rnd, end_early)
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
        tokens, verified = self.speculation.run_round(rnd, self.worker.graphs, self.decode)
        if verified is not None:
            stats = self.stats_counters
            stats.spec_verify_rows += len(verified.tokens)
            stats.spec_draft_tokens += verified.num_draft_tokens
            stats.spec_accepted_tokens += verified.num_accepted_tokens
        return tokens

    def stats(self) -> EngineStats:
        """A snapshot; safe to call from another thread."""
        gc_collections, gc_seconds = gc_stats.totals()
        # the counter dicts are replaced, never mutated, so sharing them is safe
        return dataclasses.replace(self.stats_counters, num_running=len(self.scheduler.running),
                                   num_waiting=len(self.scheduler.waiting),
                                   kv_blocks_free=self.block_manager.num_free_blocks,
                                   kv_cache_usage=self.block_manager.usage,
                                   num_preemptions=self.scheduler.num_preemptions,
                                   grammar_requests=self.structured.num_requests,
                                   kv_blocks_cached_free=self.block_manager.num_cached_free_blocks,
                                   prefix_cache_queries=self.scheduler.num_queried_tokens,
                                   prefix_cache_hits=self.scheduler.num_cached_tokens,
                                   **self.worker.counters(), **self._lora_stats(),
                                   gc_full_collections=gc_collections, gc_full_collection_seconds=gc_seconds)

    def _lora_stats(self) -> dict:
        """The LoRA adapters of running and of waiting requests (EngineStats fields), with the time they
        last changed."""
        if self.worker.loras is None:
            return {}
        running_seqs, waiting_seqs = list(self.scheduler.running), [*self.scheduler.waiting, *self._lora_loading]
        running = sorted({s.lora.name for s in running_seqs if s.lora is not None})
        waiting = sorted({s.lora.name for s in waiting_seqs if s.lora is not None})
        if (running, waiting) != self._lora_info[:2]:
            self._lora_info = (running, waiting, time.time())
        return dict(max_loras=self.config.max_loras, lora_running=running, lora_waiting=waiting,
                    lora_updated_at=self._lora_info[2])
