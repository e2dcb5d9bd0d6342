"""The offline API: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, device: str = "auto", **config: Any):
        self.engine = LLMEngine(EngineConfig(model=model, device=device, **config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run all prompts together (continuous batching) and return their final outputs in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        seqs = [self.engine.make_sequence(str(next(self._ids)), p, sp)
                for p, sp in zip(prompts, params_list)]
        for seq in seqs:
            self.engine.add_sequence(seq)
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(seqs):
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[s.request_id] for s in seqs]
