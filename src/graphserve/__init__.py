"""graphserve: an OpenAI-compatible LLM inference server.

The offline API is importable from here: `from graphserve import LLM, SamplingParams`.
The HTTP server is `graphserve serve` (graphserve.server); the engine is graphserve.engine;
the Triton kernels are graphserve.kernels.
"""

__all__ = ["AsyncEngine", "EngineConfig", "LLM", "LLMEngine", "LoraRequest", "RequestOutput", "SamplingParams",
           "TokenLogprob"]

_HOMES = {
    "AsyncEngine": "graphserve.engine.async_engine",
    "EngineConfig": "graphserve.engine.config",
    "LLM": "graphserve.engine.llm",
    "LLMEngine": "graphserve.engine.llm_engine",
    "LoraRequest": "graphserve.engine.request",
    "RequestOutput": "graphserve.engine.request",
    "SamplingParams": "graphserve.engine.request",
    "TokenLogprob": "graphserve.engine.request",
}


def __getattr__(name: str):
    # loaded on first use: `graphserve --help` should not import torch
    if name not in _HOMES:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
