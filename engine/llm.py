"""The offline API: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from typing import Any

from graphserve.engine.config import EngineConfig
from graphserve.engine.llm_engine import LLMEngine
from graphserve.engine.request import LoraRequest, RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, device: str = "auto", *, tp_rank: int = 0,
                 tp_init_method: str | None = None, **config: Any):
        """config: EngineConfig's fields. With tensor_parallel_size N > 1, run one LLM per rank
        (tp_rank 0..N-1, the same tp_init_method tcp://host:port) on the same prompts."""
        self.engine = LLMEngine(EngineConfig(model=model, device=device, **config), tp_rank, tp_init_method)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoraRequest | list[LoraRequest | None] | None = None) -> list[RequestOutput]:
        """Run all prompts together (continuous batching) and return each one's whole output, in order.
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base model); the
        engine needs enable_lora."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        seqs = [self.engine.make_sequence(str(next(self._ids)), p, sp, lora)
                for p, sp, lora in zip(prompts, params_list, loras)]
        for seq in seqs:
            self.engine.add_sequence(seq)
        results: dict[str, RequestOutput] = {}
        while any(not r.finished for r in results.values()) or len(results) < len(seqs):
            for update in self.engine.step():
                if update.request_id in results:
                    results[update.request_id].merge(update)
                else:
                    results[update.request_id] = update
        return [results[s.request_id] for s in seqs]
