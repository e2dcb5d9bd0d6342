"""Turn a validated request body into the engine's SamplingParams."""

from __future__ import annotations

from dataclasses import replace

from engine.errors import InvalidRequestError
from engine.request import SamplingParams
from server.errors import bad_request
from server.protocol import _SamplingFields


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
    """One SamplingParams for the first choice; `for_choice` derives the others."""
    for token_id in body.stop_token_ids or []:
        check_token_id(token_id, vocab_size, "stop_token_ids")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens,  # type: ignore[arg-type]  # None: as many as fit in max_model_len
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=body.seed,
            stop=stop,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=parse_logit_bias(body.logit_bias, vocab_size),
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
        )
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def for_choice(params: SamplingParams, choice_index: int) -> SamplingParams:
    """A private copy for choice i (the engine may fill in max_tokens=None per prompt);
    choice i of a seeded request samples with seed + i, so the n choices differ."""
    seed = None if params.seed is None else params.seed + choice_index
    return replace(params, seed=seed, stop=list(params.stop), logit_bias=dict(params.logit_bias))
