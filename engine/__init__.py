"""graphserve engine: from a request to tokens."""

from engine.config import EngineConfig
from engine.request import RequestOutput, SamplingParams, TokenLogprob

__all__ = ["AsyncEngine", "EngineConfig", "LLM", "LLMEngine", "RequestOutput", "SamplingParams", "TokenLogprob"]


def __getattr__(name: str):
    # heavy modules (torch, the model) load on first use
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
