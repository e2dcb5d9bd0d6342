"""LLMEngine: the engine core with its text side in one process (the offline `LLM` API
and unit tests). `step()` runs one core step and returns the updates of the requests it
touched; a stop string found in the text ends the request in the core at once."""

from __future__ import annotations

from graphserve.engine.config import EngineConfig
from graphserve.engine.core.engine_core import EngineCore
from graphserve.engine.inputs import InputProcessor, ModelLimits
from graphserve.engine.output import OutputProcessor
from graphserve.engine.request import LoraRequest, RequestOutput, SamplingParams, Sequence
from graphserve.engine.stats import EngineStats
from graphserve.engine.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, tp_init_method: str | None = None):
        self.config = config
        self.core = EngineCore(config, tp_rank, tp_init_method)
        self.tokenizer = Tokenizer(self.core.model_path)
        self.inputs = InputProcessor(self.tokenizer, ModelLimits(self.core.max_model_len, self.core.args.vocab_size))
        self.outputs = OutputProcessor(self.tokenizer)

    # the core's parts, for tests and benchmarks
    @property
    def model_path(self) -> str:
        return self.core.model_path

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def block_manager(self):
        return self.core.block_manager

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.worker.runner

    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      lora: LoraRequest | None = None) -> Sequence:
        """Validate the user's params (the offline API's edge: SamplingParams.validate, once),
        tokenize and fit max_tokens; raises InvalidRequestError before anything is queued.
        lora: the LoRA adapter the request runs with (read when a request first needs it)."""
        token_ids, params = self.inputs.check(prompt, params.validate())
        return self.core.make_sequence(request_id, token_ids, params, lora=lora)

    def add_sequence(self, seq: Sequence) -> None:
        self.core.add_sequence(seq)
        self.outputs.add(seq.request_id, seq.prompt_token_ids, seq.params)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    lora: LoraRequest | None = None) -> Sequence:
        seq = self.make_sequence(request_id, prompt, params, lora)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.outputs.discard(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def inject_fault(self, kind: str, request_id: str | None = None) -> None:
        self.core.inject_fault(kind, request_id)

    def step(self) -> list[RequestOutput]:
        updates = []
        for out in self.core.step():
            processed = self.outputs.process(out)
            if processed is None:
                continue
            update, stopped_here = processed
            if stopped_here:
                self.core.abort(out.request_id)
            updates.append(update)
        return updates

    def stats(self) -> EngineStats:
        return self.core.stats()
