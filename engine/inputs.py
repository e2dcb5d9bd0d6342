"""InputProcessor: a prompt (text or token ids) and its SamplingParams, checked against
the model before the request costs the engine anything. Runs where the request arrives
(a front end, or the offline engine); the core trusts what it gets."""

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

    def check(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """Tokenize and validate; returns the prompt ids and a copy of `params` whose
        max_tokens is set (None: as many as fit). Raises InvalidRequestError."""
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
        n = len(token_ids)
        params = dataclasses.replace(params)  # filled in below; the caller's object stays as it was
        if params.max_tokens is None:
            if n >= max_len:
                raise PromptTooLongError(f"This model's maximum context length is {max_len} tokens, "
                                         f"but the prompt has {n} tokens.", param="prompt")
            params.max_tokens = max_len - n
            params.min_tokens = min(params.min_tokens, params.max_tokens)
        if n + params.max_tokens > max_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion). "
                f"Please reduce the prompt or max_tokens.", param="max_tokens" if n < max_len else "prompt")
        return token_ids, params
