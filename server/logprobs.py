"""Format the engine's TokenLogprob lists as OpenAI completions / chat logprobs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from graphserve.engine.request import TokenLogprob
from graphserve.server.response_bodies import ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

TokenText = Callable[[int], str]

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with this floor.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    if math.isnan(logprob) or logprob < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return float(logprob)


def append_completion_logprobs(
    out: CompletionLogprobs,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    token_text: TokenText,
    text_offset: int,
) -> int:
    """Append one entry per token to `out`; returns the text offset after the last token.

    `entries[i]` belongs to `token_ids[i]`; None (the first prompt token) has no logprob.
    The top_logprobs dict always holds the chosen token too, so it may have N + 1 keys.
    """
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = token_text(token_id)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(finite(entry.logprob))
        top = {token_text(alt_id): finite(alt_logprob) for alt_id, alt_logprob in entry.top}
        top.setdefault(text, finite(entry.logprob))
        out.top_logprobs.append(top)
    return text_offset


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, num_top: int) -> list[ChatTokenLogprob]:
    result = []
    for entry in entries:
        text = token_text(entry.token_id)
        result.append(
            ChatTokenLogprob(
                token=text,
                logprob=finite(entry.logprob),
                bytes=list(text.encode("utf-8")),
                top_logprobs=[_chat_top_logprob(token_text(alt_id), alt_lp) for alt_id, alt_lp in entry.top[:num_top]],
            )
        )
    return result


def _chat_top_logprob(text: str, logprob: float) -> ChatTopLogprob:
    return ChatTopLogprob(token=text, logprob=finite(logprob), bytes=list(text.encode("utf-8")))
