"""Turn a validated request body into the engine's SamplingParams."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.request import SamplingParams
from server.errors import bad_request
from server.protocol import _SamplingFields

# Body fields that SamplingParams takes as they are; one the client left out (None) keeps
# SamplingParams' default, and SamplingParams itself turns a `stop` string into a list.
_PASSED_THROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
)


def parse_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    parsed: dict[int, float] = {}
    for key, bias in (logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        check_token_id(token_id, vocab_size, "logit_bias")
        parsed[token_id] = float(bias)
    return parsed


def check_token_id(token_id: int, vocab_size: int, param: str) -> None:
    if not 0 <= token_id < vocab_size:
        raise bad_request(f"{param}: token id {token_id} is outside the vocabulary [0, {vocab_size})", param=param)


def build_sampling_params(
    body: _SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
) -> SamplingParams:
    """One SamplingParams for the first choice; `for_choice` derives the others. A value
    SamplingParams rejects raises the engine's InvalidRequestError (a 400, errors.py)."""
    for token_id in body.stop_token_ids or []:
        check_token_id(token_id, vocab_size, "stop_token_ids")
    given: dict[str, Any] = {name: getattr(body, name) for name in _PASSED_THROUGH}
    return SamplingParams(
        **{name: value for name, value in given.items() if value is not None},
        max_tokens=max_tokens,  # None: as many as fit in max_model_len
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=parse_logit_bias(body.logit_bias, vocab_size),
    )


def for_choice(params: SamplingParams, choice_index: int, **changes: Any) -> SamplingParams:
    """The params of choice i, with `changes` applied: choice i of a seeded request samples
    with seed + i, so the n choices differ. The copy is shallow (the engine copies params
    itself and never mutates their lists or dicts)."""
    seed = None if params.seed is None else params.seed + choice_index
    return replace(params, seed=seed, **changes)
