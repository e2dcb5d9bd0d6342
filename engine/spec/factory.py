"""Speculative decoding built from the engine config: the drafter of each method, the rounds' batch limit."""

from __future__ import annotations

import torch

from graphserve.engine.config import EngineConfig
from graphserve.engine.errors import InvalidConfigError
from graphserve.engine.runner.cuda_graphs import GraphDecoder
from graphserve.engine.runner.model_runner import ModelRunner
from graphserve.engine.runner.worker import Worker
from graphserve.engine.spec.draft_model import DraftModelDrafter
from graphserve.engine.spec.drafter import Drafter
from graphserve.engine.spec.ngram import NgramDrafter
from graphserve.engine.spec.speculative_decoder import SpeculativeDecoder

# Rounds of more sequences do not speculate unless EngineConfig.speculative_max_batch says otherwise.
# CPU: verifying k + 1 rows costs more than a decode step on 2 cores, so the gain fades with the
# batch: served n-gram speculation (benchmarks/spec_serving.py, 30 input-grounded prompts, k = 4,
# acceptance 0.52) gave output tok/s 1.67x / 1.37x / 1.18x / 1.03x of speculation off at 1 / 2 / 4 / 8
# streams (2026-12-05). CUDA: a verify step of B x (k + 1) rows stops being a memory-bound step as B
# grows; Llama-3.1-8B bf16 on an H200 (benchmarks/speculative.py, k = 4, 2026-12-06) gave 1.76x /
# 1.37x / 0.99x / 0.72x of speculation off at batch 8 / 16 / 32 / 64 with 70% of drafts right, and
# 1.17x / 0.99x / 0.73x / 0.53x with 50%.
CPU_MAX_BATCH = 8
CUDA_MAX_BATCH = 16


def default_max_batch(device: torch.device) -> int:
    return CPU_MAX_BATCH if device.type == "cpu" else CUDA_MAX_BATCH


def make_drafter(method: str, draft_runner: ModelRunner | None = None, k: int = 4, max_model_len: int = 0,
                 draft_graphs: GraphDecoder | None = None) -> Drafter:
    """The drafter of `method`; "draft" runs on the draft model's runner (and its graphs, on CUDA)."""
    if method == "ngram":
        return NgramDrafter()
    if method == "draft" and draft_runner is not None:
        return DraftModelDrafter(draft_runner, k, max_model_len, draft_graphs)
    raise InvalidConfigError(f"unknown speculative_method {method!r}")


def build_speculation(config: EngineConfig, worker: Worker) -> SpeculativeDecoder | None:
    """The engine's SpeculativeDecoder for config.speculative_method (None: off), its drafter on the
    worker's draft model (runner and graphs) for "draft"."""
    if config.speculative_method is None:
        return None
    k = config.num_speculative_tokens
    drafter = make_drafter(config.speculative_method, worker.draft_runner, k, worker.max_model_len,
                           worker.draft_graphs)
    max_batch = config.speculative_max_batch
    return SpeculativeDecoder(drafter, k, worker.runner, worker.block_manager, worker.max_model_len,
                              max_batch if max_batch is not None else default_max_batch(worker.device))
