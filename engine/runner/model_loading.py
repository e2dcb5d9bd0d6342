"""Loading the served model and the draft model onto the device, and the model's end-of-sequence ids."""

from __future__ import annotations

import torch

from graphserve.engine.config import EngineConfig
from graphserve.engine.distributed import TensorParallel
from graphserve.engine.errors import InvalidConfigError
from graphserve.engine.model_files.model_path import resolve_model_path
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.runner.device_setup import resolve_quantization
from graphserve.engine.tokenizer import Tokenizer


def stop_token_ids(model_path: str, args: ModelArgs) -> tuple[int, ...]:
    """The model's end-of-sequence ids: its config's, then its tokenizer's, each once."""
    eos_token_id = Tokenizer(model_path).eos_token_id
    return tuple(dict.fromkeys([*args.eos_token_ids, *([eos_token_id] if eos_token_id is not None else [])]))


def load_models(config: EngineConfig, model_path: str, args: ModelArgs, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel, quantization: str | None, max_positions: int):
    """The served model and, for speculative_method "draft", the draft model (else None), on one
    attention backend. The draft model comes before the KV pools are sized: its pool holds as many
    blocks as the target's."""
    from graphserve.engine.models.attention import make_attention_backend
    from graphserve.engine.models.loading.loader import load_model

    backend = make_attention_backend(device, config.block_size)
    model = load_model(model_path, dtype, device, backend, max_positions, tp, quantization, config.load_format)
    if config.speculative_method != "draft":
        return model, None
    return model, _load_draft_model(config, args, dtype, device, backend, max_positions)


def _load_draft_model(config: EngineConfig, target_args: ModelArgs, dtype: torch.dtype, device: torch.device,
                      backend, max_positions: int):
    """The draft model of speculative_method "draft": the target's dtype, device, attention backend
    and quantization setting (a GGUF draft on CPU: its blocks) unless draft_quantization says
    otherwise, a vocabulary within the target's (the same tokenizer)."""
    from graphserve.engine.models.loading.loader import load_model

    path = resolve_model_path(config.draft_model)
    draft_args = ModelArgs.from_dir(path)
    if draft_args.vocab_size > target_args.vocab_size:
        raise InvalidConfigError(f"the draft model {path} has a vocabulary of {draft_args.vocab_size} tokens, more "
                                 f"than the target's {target_args.vocab_size}: a draft model must share its tokenizer")
    return load_model(path, dtype, device, backend, max_positions,
                      quantization=config.draft_quantization or resolve_quantization(config, path, device),
                      load_format=config.load_format)
