"""Turn a validated request body into the engine's SamplingParams."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from graphserve.engine.request import SEED_MAX, SEED_MIN, SamplingParams
from graphserve.engine.structured.grammar import GrammarSpec
from graphserve.server.errors import bad_request
from graphserve.server.protocol import _SamplingFields

# Body fields that SamplingParams takes as they are; one the client left out (None) keeps
# SamplingParams' default, and SamplingParams.validate turns a `stop` string into a list.
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
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    """One SamplingParams for the first choice, validated: the HTTP edge's one
    SamplingParams.validate; `for_choice` derives the others without checking again. A value
    it rejects raises the engine's InvalidRequestError (a 400, errors.py). max_tokens goes as
    the body has it; engine/inputs.py fits it to the context."""
    for token_id in body.stop_token_ids or []:
        check_token_id(token_id, vocab_size, "stop_token_ids")
    given: dict[str, Any] = {name: getattr(body, name) for name in _PASSED_THROUGH}
    return SamplingParams(
        **{name: value for name, value in given.items() if value is not None},
        max_tokens=max_tokens,  # None: as many as fit in max_model_len
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=parse_logit_bias(body.logit_bias, vocab_size),
        grammar=grammar,
    ).validate()


def for_choice(params: SamplingParams, choice_index: int) -> SamplingParams:
    """The params of choice i: choice i of a seeded request samples with seed + i (wrapped
    into int64, so seed 2**63 - 1 with n > 1 stays valid), so the n choices differ. The copy
    is shallow (the engine copies params itself and never mutates their lists or dicts)."""
    seed = None if params.seed is None else wrap_seed(params.seed + choice_index)
    return replace(params, seed=seed)


def wrap_seed(seed: int) -> int:
    """`seed` modulo 2**64, as a signed int64 (the low 32 bits, which the sampler hashes, are kept)."""
    span = SEED_MAX - SEED_MIN + 1
    return (seed - SEED_MIN) % span + SEED_MIN


SUMMARY_ITEMS = 3  # items shown of each list or dict
SUMMARY_STRING_CHARS = 100
SUMMARY_MAX_CHARS = 500


def summarize_params(params: SamplingParams) -> str:
    """SamplingParams for a log line, bounded whatever the request held: only the fields that
    differ from the defaults; each list or dict shows its first few items and its length,
    each string at most ~100 characters, the whole line at most ~500."""
    defaults = SamplingParams()
    parts = []
    for f in fields(params):
        value = getattr(params, f.name)
        if value == getattr(defaults, f.name):
            continue
        parts.append(f"{f.name}={_summarize(value)}")
    line = "SamplingParams(" + ", ".join(parts) + ")"
    if len(line) > SUMMARY_MAX_CHARS:
        line = line[: SUMMARY_MAX_CHARS - 4] + "...)"
    return line


def _summarize(value: Any) -> str:
    if isinstance(value, str):
        return _short_string(value)
    if isinstance(value, (list, tuple)):
        shown = ", ".join(_summarize(v) for v in value[:SUMMARY_ITEMS])
        more = f", ... ({len(value)} items)" if len(value) > SUMMARY_ITEMS else ""
        return f"[{shown}{more}]"
    if isinstance(value, dict):
        items = list(value.items())[:SUMMARY_ITEMS]
        shown = ", ".join(f"{_summarize(k)}: {_summarize(v)}" for k, v in items)
        more = f", ... ({len(value)} items)" if len(value) > SUMMARY_ITEMS else ""
        return "{" + shown + more + "}"
    text = repr(value)
    return text if len(text) <= SUMMARY_STRING_CHARS else text[:SUMMARY_STRING_CHARS] + "..."


def _short_string(text: str) -> str:
    if len(text) <= SUMMARY_STRING_CHARS:
        return repr(text)
    return repr(text[:SUMMARY_STRING_CHARS]) + f"...({len(text)} chars)"
