"""LLMEngine: the synchronous core. Owns the model, KV cache, scheduler and runner;
`step()` runs one prefill batch or one decode round and returns the outputs.

Overlap (EngineConfig.overlap_rounds): a decode round through the graph decoder is left
in flight on the device; the next step launches the round after it (when the scheduler
can tell it without the tokens of the one in flight) before it waits for and processes
the one in flight, so the device never idles while the host works."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import GraphDecoder, RoundHandle, eager_reason
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.kv_cache import BlockManager, allocate_kv_cache, kv_bytes_per_block
from engine.models.config import ModelArgs
from engine.output import OutputProcessor
from engine.request import RequestOutput, SamplingParams, Sequence
from engine.runner import ModelRunner, StepTokens
from engine.scheduler import DecodeRound, PrefillBatch, Scheduler
from engine.tokenizer import Tokenizer

logger = logging.getLogger("graphserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    num_preemptions: int = 0
    decode_rounds: int = 0
    decode_rounds_ahead: int = 0  # rounds launched before the previous round's tokens were read
    prefill_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    graph_replays: dict[int, int] = field(default_factory=dict)  # batch bucket -> decode steps replayed
    eager_rounds: dict[str, int] = field(default_factory=dict)  # reason -> decode rounds run eagerly


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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from engine.attention import make_attention_backend
        from engine.models.loader import load_model

        self.config = config
        self.model_path = self._resolve_model_path(config.model)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        args = ModelArgs.from_dir(self.model_path)
        self.args = args
        self.tokenizer = Tokenizer(self.model_path)
        self.dtype = resolve_dtype(config.dtype, args, self.device)
        self.eos_ids = tuple(dict.fromkeys(
            [*args.eos_token_ids, *([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])]))

        started = time.perf_counter()
        max_len_wanted = config.max_model_len or args.max_position_embeddings
        backend = make_attention_backend(self.device, config.block_size)
        self.model = load_model(self.model_path, self.dtype, self.device, backend, max_len_wanted)
        num_blocks = self._num_kv_blocks()
        self.max_model_len = min(max_len_wanted, (num_blocks - 1) * config.block_size)
        self.kv_caches = allocate_kv_cache(args, num_blocks, config.block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_caches, self.block_manager, self.device, self.eos_ids)
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = GraphDecoder(self.runner, min(config.max_num_seqs, config.cuda_graph_max_batch),
                                       config.decode_chunk, -(-self.max_model_len // config.block_size))
            self.graphs.capture()
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids)
        self.sequences: dict[str, Sequence] = {}
        self.stats_counters = EngineStats(kv_blocks_total=self.block_manager.num_usable_blocks)
        self._injected_fault: str | None = None
        self._in_flight: RoundHandle | None = None  # a launched decode round, not collected yet
        self._seeds = random.Random(config.seed)
        logger.info("loaded %s (%s, %d layers) on %s in %s: %.1fs; KV pool %d blocks x %d tokens, max_model_len %d",
                    self.model_path, args.architecture, args.num_layers, self.device, str(self.dtype).split(".")[-1],
                    time.perf_counter() - started, num_blocks, config.block_size, self.max_model_len)

    @staticmethod
    def _resolve_model_path(model: str | None) -> str:
        if model is None:
            from engine.models.default_model import ensure_default_model

            return str(ensure_default_model())
        return model

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_block(self.args, cfg.block_size, self.dtype)
        if self.device.type == "cuda":
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

    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate; raises InvalidRequestError before anything is queued."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if not token_ids:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.args.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary (0..{self.args.vocab_size - 1})",
                                          param="prompt")
        n = len(token_ids)
        params = dataclasses.replace(params)  # filled in below; the caller's object stays as it was
        if params.max_tokens is None:
            if n >= self.max_model_len:
                raise PromptTooLongError(f"This model's maximum context length is {self.max_model_len} tokens, "
                                         f"but the prompt has {n} tokens.", param="prompt")
            params.max_tokens = self.max_model_len - n
            params.min_tokens = min(params.min_tokens, params.max_tokens)
        if n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion). "
                f"Please reduce the prompt or max_tokens.", param="max_tokens" if n < self.max_model_len else "prompt")
        # unseeded requests draw their seed from the engine's generator (EngineConfig.seed)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        return Sequence(request_id, token_ids, params, seed)

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.sequences:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already running")
        self.sequences[seq.request_id] = seq
        self.outputs.start(seq)
        self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        seq = self.make_sequence(request_id, prompt, params)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        self._drop_unwanted_round()
        return self.outputs.make_output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # ---- the step ------------------------------------------------------------------

    def inject_fault(self, kind: str) -> None:
        """Tests only: make the next step fail. "step": the model run raises (only the requests
        in that step fail); "fatal": the engine's own bookkeeping raises (the engine dies)."""
        if kind not in ("step", "fatal"):
            raise ValueError(f"unknown fault kind {kind!r}")
        self._injected_fault = kind

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch, or (overlap) collect the decode round in flight after
        launching the next one; returns the outputs of one batch or round. An exception from
        the model run fails only the requests of that batch or round (finish_reason "error",
        blocks freed); anything else propagates."""
        if self._injected_fault == "fatal":
            self._injected_fault = None
            raise RuntimeError("injected fatal engine fault")
        if self._in_flight is None:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            if not self._overlaps(batch):
                return self._run_now(batch)
            try:
                self._take_step_fault()
                self._in_flight = self._launch(batch)
            except Exception:
                logger.exception("launching a decode round failed; failing its %d requests", len(batch.seqs))
                return self._fail_all(batch.seqs)
        return self._collect_in_flight()

    def _overlaps(self, batch: PrefillBatch | DecodeRound) -> bool:
        return (self.config.overlap_rounds and isinstance(batch, DecodeRound)
                and self._eager_reason(batch) is None)

    def _run_now(self, batch: PrefillBatch | DecodeRound) -> list[RequestOutput]:
        """A batch run and processed synchronously: prefills, eager rounds, no overlap."""
        try:
            self._take_step_fault()
            if isinstance(batch, PrefillBatch):
                new_tokens = self.runner.prefill(batch)
            else:
                new_tokens = self.decode(batch)
        except Exception:
            logger.exception("engine step failed; failing the %d requests in it", len(batch.seqs))
            return self._fail_all(batch.seqs)
        return self._process(batch, new_tokens)

    def _collect_in_flight(self) -> list[RequestOutput]:
        """Launch the round after the one in flight if the scheduler can already tell it,
        then wait for the one in flight and process its tokens."""
        prev, self._in_flight = self._in_flight, None
        ahead = self.scheduler.schedule_decode_ahead(prev.rnd)
        if ahead is not None:
            try:
                self._take_step_fault()
                self._in_flight = self._launch(ahead, pending=prev.rnd.num_steps)
            except Exception:  # the same requests as prev's: their tokens in flight go with them
                logger.exception("launching a decode round ahead failed; failing its %d requests", len(ahead.seqs))
                return self._fail_all(ahead.seqs)
            self.stats_counters.decode_rounds_ahead += 1
        try:
            new_tokens, _ = self.graphs.collect(prev)
        except Exception:
            logger.exception("collecting a decode round failed; failing its %d requests", len(prev.rnd.seqs))
            self._in_flight = None  # the round ahead, if any, continues the same requests
            return self._fail_all(prev.rnd.seqs)
        outputs = self._process(prev.rnd, new_tokens)
        self._drop_unwanted_round()
        return outputs

    def _drop_unwanted_round(self) -> None:
        """Forget the round in flight once every request in it has ended: nobody needs its
        tokens. The device still runs it, before anything launched later (one stream), and
        the graph decoder reuses its host buffers only after its event."""
        if self._in_flight is not None and all(s.is_finished for s in self._in_flight.rnd.seqs):
            self._in_flight = None

    def _process(self, batch: PrefillBatch | DecodeRound, new_tokens: dict[str, StepTokens]) -> list[RequestOutput]:
        """Append a batch's tokens, end the sequences that are done, and make their outputs."""
        stats = self.stats_counters
        if isinstance(batch, PrefillBatch):
            stats.prefill_steps += 1
            stats.prompt_tokens += sum(batch.chunk_lens)
            touched = [s for s in batch.seqs if not s.in_prefill]
        else:
            stats.decode_rounds += 1
            # a sequence that ended (stop, abort) while its round was in flight: its tokens are dropped
            touched = [s for s in batch.seqs if not s.is_finished]
        outputs = []
        for seq in touched:
            step = new_tokens.get(seq.request_id)
            if step is not None:
                stats.generation_tokens += self.outputs.append(seq, step)
                if not seq.is_finished and isinstance(batch, DecodeRound):
                    seq.num_computed_tokens = seq.num_tokens - 1
            elif seq.num_output_tokens >= seq.params.max_tokens:  # max_tokens 0: prompt logprobs only
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self.sequences.pop(seq.request_id, None)
            outputs.append(self.outputs.make_output(seq))
        return outputs

    def _take_step_fault(self) -> None:
        if self._injected_fault == "step":
            self._injected_fault = None
            raise RuntimeError("injected step fault")

    def _fail_all(self, seqs: list[Sequence]) -> list[RequestOutput]:
        return [self._fail(seq) for seq in seqs if not seq.is_finished]

    def _fail(self, seq: Sequence) -> RequestOutput:
        self.scheduler.finish(seq)
        self.sequences.pop(seq.request_id, None)
        seq.finish_reason = "error"
        return self.outputs.make_output(seq)

    def _eager_reason(self, rnd: DecodeRound) -> str | None:
        """Why `rnd` cannot go through the graph decoder, or None if it can."""
        if self.graphs is None:
            return "cpu" if self.device.type == "cpu" else "enforce_eager"
        return eager_reason(rnd.seqs, self.graphs.max_bucket)

    def _launch(self, rnd: DecodeRound, pending: int = 0) -> RoundHandle:
        handle = self.graphs.launch(rnd, pending)
        stats = self.stats_counters
        # copy-on-write: stats() may read these dicts from another thread at any time
        stats.graph_replays = {**stats.graph_replays, handle.bucket: stats.graph_replays.get(handle.bucket, 0)
                               + rnd.num_steps}
        return handle

    def decode(self, rnd: DecodeRound) -> dict[str, StepTokens]:
        """A decode round run to the end: through the graphs when they can take it, else
        eagerly (counted by reason)."""
        reason = self._eager_reason(rnd)
        if reason is None:
            return self.graphs.collect(self._launch(rnd))[0]
        stats = self.stats_counters
        stats.eager_rounds = {**stats.eager_rounds, reason: stats.eager_rounds.get(reason, 0) + 1}
        return self.runner.decode(rnd)

    def stats(self) -> EngineStats:
        """A snapshot; safe to call from another thread."""
        # the counter dicts are replaced, never mutated, so sharing them is safe
        return dataclasses.replace(self.stats_counters, num_running=len(self.scheduler.running),
                                   num_waiting=len(self.scheduler.waiting),
                                   kv_blocks_free=self.block_manager.num_free_blocks,
                                   num_preemptions=self.scheduler.num_preemptions)
