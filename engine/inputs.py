"""InputProcessor: a prompt (text or token ids) and its SamplingParams, checked against
the model before the request costs the engine anything. Runs where the request arrives
(a front end, or the offline engine): the one place max_tokens is fitted to the context.
The core trusts what it gets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from graphserve.engine.errors import InvalidRequestError, PromptTooLongError
from graphserve.engine.request import SamplingParams
from graphserve.engine.structured.grammar import check_spec
from graphserve.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelLimits:
    """What the core tells a front end about the model it serves."""

    max_model_len: int
    vocab_size: int


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, limits: ModelLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    def check(self, prompt: str | list[int], params: SamplingParams, *,
              max_tokens_defaulted: bool = False) -> tuple[list[int], SamplingParams]:
        """Tokenize and check the prompt; returns its ids and a copy of `params` whose
        max_tokens fits the context (fit_max_tokens). `params` were validated where they
        entered (SamplingParams.validate); not again here. Raises InvalidRequestError."""
        max_len, vocab = self.limits.max_model_len, self.limits.vocab_size
        if params.grammar is not None:
            check_spec(params.grammar)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if not token_ids:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            bad = [t for t in token_ids if type(t) is not int or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary (0..{vocab - 1})",
                                          param="prompt")
        params = dataclasses.replace(params)  # filled in below; the caller's object stays as it was
        params.max_tokens = fit_max_tokens(params.max_tokens, len(token_ids), max_len, defaulted=max_tokens_defaulted)
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        return token_ids, params


def fit_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int, *, defaulted: bool = False) -> int:
    """The one place max_tokens is fitted to the context (prompt + max_tokens <= max_model_len).
    None: as many as fit. `defaulted`: a default the client never chose (completions' 16 when
    the body leaves max_tokens out) is clamped to what fits, so it cannot make a request fail.
    A number the client gave that does not fit is a PromptTooLongError."""
    n, max_len = prompt_len, max_model_len
    if max_tokens is None or defaulted:
        if n >= max_len:
            raise PromptTooLongError(f"This model's maximum context length is {max_len} tokens, "
                                     f"but the prompt has {n} tokens.", param="prompt")
        return max_len - n if max_tokens is None else min(max_tokens, max_len - n)
    if n + max_tokens > max_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the prompt or max_tokens.", param="max_tokens" if n < max_len else "prompt")
    return max_tokens
