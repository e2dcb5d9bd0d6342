"""The gpt-oss reasoning parser (`--reasoning-parser gpt-oss`): OpenAI's harmony format, read from
the output text with its special tokens kept. An output is a run of messages, each a header then a
body: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`
(the first message's `<|start|>assistant` is the prompt's end). The analysis channel is the
thinking; the final channel, and commentary without a recipient (a preamble to the user), the
answer; a message addressed to a tool (`to=functions.NAME`, a harmony tool call) is neither, as in
vLLM's parser.

Parsed here rather than with the openai-harmony package: its encoding loads the o200k_base
vocabulary file, which it downloads at run time (no download: no parser), while the model's own
tokenizer already writes the markers as text."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
TERMINATORS = ("<|end|>", "<|return|>", "<|call|>")  # a message's end: the next one may follow, or the output ends

_HEADER, _BODY = "header", "body"
_REASONING, _CONTENT, _TOOL = "reasoning", "content", "tool"
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _held_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-k:]):
                longest = k
                break
    return longest


def message_route(header: str) -> str:
    """Where a message's body goes, from its header (the text before `<|message|>`)."""
    if _RECIPIENT.search(header):
        return _TOOL
    channel = _CHANNEL_NAME.search(header)
    return _REASONING if channel is not None and channel.group(1) == "analysis" else _CONTENT


@dataclass
class HarmonySplitter:
    """One choice's harmony output, fed text piece by piece: what is new thinking and what is new
    answer (server/reasoning.py's ReasoningSplitter, for harmony). A marker split across pieces is
    held back until it is clear; feeding the whole text once gives the same split."""

    reasoning: str = ""
    content: str = ""
    entered: bool = False  # the output had an analysis message (possibly empty)
    _state: str = _HEADER
    _route: str = _CONTENT
    _pending: str = ""

    def feed(self, text: str, token_ids: Any = ()) -> tuple[str, str]:
        """(new thinking text, new answer text) after `text`."""
        self._pending += text
        parts = {_REASONING: "", _CONTENT: "", _TOOL: ""}
        while self._pending:
            if self._state == _HEADER:
                at = self._pending.find(MESSAGE)
                if at >= 0:
                    self._route = message_route(self._pending[:at])
                    self.entered = self.entered or self._route == _REASONING
                    self._pending, self._state = self._pending[at + len(MESSAGE):], _BODY
                    continue
                head = self._pending.lstrip()
                if head and not head.startswith("<|") and not "<|".startswith(head):
                    self._route, self._state = _CONTENT, _BODY  # no header at all: plain text is answer
                    continue
                break  # a header still arriving
            ends = [(at, marker) for marker in TERMINATORS if (at := self._pending.find(marker)) >= 0]
            if ends:
                at, marker = min(ends)
                parts[self._route] += self._pending[:at]
                self._pending, self._state = self._pending[at + len(marker):], _HEADER
                continue
            keep = _held_tail(self._pending, TERMINATORS)
            parts[self._route] += self._pending[:len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
            break
        self.reasoning += parts[_REASONING]
        self.content += parts[_CONTENT]
        return parts[_REASONING], parts[_CONTENT]

    def finish(self) -> tuple[str, str]:
        """At the end of the output: a body's held-back tail is its own; an unfinished header is dropped."""
        leftover, self._pending = self._pending, ""
        if self._state == _HEADER or self._route == _TOOL:
            return "", ""
        if self._route == _REASONING:
            self.reasoning += leftover
            return leftover, ""
        self.content += leftover
        return "", leftover

    def count_tokens(self, tokenizer: Any) -> int:
        """reasoning_tokens once the output is complete: the thinking text's tokens."""
        return len(tokenizer.encode(self.reasoning, add_special_tokens=False)) if self.reasoning else 0

    def message_fields(self) -> tuple[str | None, str | None]:
        """(reasoning, content) of the whole message: None for a part the output lacks."""
        reasoning = self.reasoning if self.entered else None
        content = self.content if self.content or reasoning is None else None
        return reasoning, content
