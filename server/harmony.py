"""The gpt-oss reasoning parser (`--reasoning-parser gpt-oss`): OpenAI's harmony format, read from
the output text with its special tokens kept. An output is a run of messages, each a header then a
body: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`
(the first message's `<|start|>assistant` is the prompt's end). The analysis channel is the
thinking; the final channel, and commentary without a recipient (a preamble to the user), the
answer; a message addressed to a function (`<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>ARGS<|call|>`, the recipient also before the channel) is a tool call, in OpenAI's form
when the request may call tools (its arguments the body's text, as the model wrote them), and a
message to another recipient (a built-in tool) neither, as vLLM's gpt-oss parsers read them.

Parsed here rather than with the openai-harmony package: its encoding loads the o200k_base
vocabulary file, which it downloads at run time (no download: no parser), while the model's own
tokenizer already writes the markers as text."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from graphserve.server.response_bodies import ResponseFunction, ResponseToolCall, new_call_id

CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
TERMINATORS = ("<|end|>", "<|return|>", "<|call|>")  # a message's end: the next one may follow, or the output ends

_HEADER, _BODY = "header", "body"
_REASONING, _CONTENT, _CALL, _TOOL = "reasoning", "content", "call", "tool"  # _TOOL: a built-in tool's message
FUNCTIONS = "functions."  # the recipients that are the request's function tools
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
# a header starts with a marker, or (the output's first, its role in the prompt) with a recipient: " to=functions.X"
_HEADER_STARTS = ("<|", "to=")


def is_harmony_template(chat_template: str | None) -> bool:
    """Whether a chat template renders harmony (gpt-oss's)."""
    return CHANNEL in (chat_template or "")


def _held_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-k:]):
                longest = k
                break
    return longest


def message_route(header: str) -> tuple[str, str]:
    """Where a message's body goes, from its header (the text before `<|message|>`), and the
    function it calls ("" unless a call)."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        name = recipient.group(1)
        return (_CALL, name[len(FUNCTIONS):]) if name.startswith(FUNCTIONS) else (_TOOL, "")
    channel = _CHANNEL_NAME.search(header)
    return (_REASONING if channel is not None and channel.group(1) == "analysis" else _CONTENT), ""


@dataclass
class HarmonySplitter:
    """One choice's harmony output, fed text piece by piece: what is new thinking and what is new
    answer (server/reasoning.py's ReasoningSplitter, for harmony), and the function calls, whose
    OpenAI stream deltas take_call_deltas() hands out. A marker split across pieces is held back
    until it is clear; feeding the whole text once gives the same split and calls."""

    reasoning: str = ""
    content: str = ""
    entered: bool = False  # the output had an analysis message (possibly empty)
    calls: list[ResponseToolCall] = field(default_factory=list)
    _state: str = _HEADER
    _route: str = _CONTENT
    _pending: str = ""
    _call_deltas: dict[int, dict] = field(default_factory=dict)  # by call index, since take_call_deltas

    def feed(self, text: str, token_ids: Any = ()) -> tuple[str, str]:
        """(new thinking text, new answer text) after `text`."""
        self._pending += text
        parts = {_REASONING: "", _CONTENT: "", _CALL: "", _TOOL: ""}
        while self._pending:
            if self._state == _HEADER:
                at = self._pending.find(MESSAGE)
                if at >= 0:
                    self._route, function = message_route(self._pending[:at])
                    self.entered = self.entered or self._route == _REASONING
                    if self._route == _CALL:
                        self._open_call(function)
                    self._pending, self._state = self._pending[at + len(MESSAGE):], _BODY
                    continue
                head = self._pending.lstrip()
                if head and not head.startswith(_HEADER_STARTS) and not any(h.startswith(head) for h in _HEADER_STARTS):
                    self._route, self._state = _CONTENT, _BODY  # no header at all: plain text is answer
                    continue
                break  # a header still arriving
            ends = [(at, marker) for marker in TERMINATORS if (at := self._pending.find(marker)) >= 0]
            if ends:
                at, marker = min(ends)
                self._add(parts, self._pending[:at])
                self._pending, self._state = self._pending[at + len(marker):], _HEADER
                continue
            keep = _held_tail(self._pending, TERMINATORS)
            self._add(parts, self._pending[:len(self._pending) - keep])
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
        parts = {_REASONING: "", _CONTENT: "", _CALL: ""}
        self._add(parts, leftover)
        self.reasoning += parts[_REASONING]
        self.content += parts[_CONTENT]
        return parts[_REASONING], parts[_CONTENT]

    def _add(self, parts: dict[str, str], body: str) -> None:
        """Body text of the open message, to its part (a call's: to its arguments)."""
        parts[self._route] += body
        if self._route == _CALL and body:
            call = self.calls[-1]
            call.function.arguments += body
            delta = self._call_deltas.setdefault(len(self.calls) - 1, {"index": len(self.calls) - 1,
                                                                     "function": {"arguments": ""}})
            delta["function"]["arguments"] += body

    def _open_call(self, function: str) -> None:
        call = ResponseToolCall(id=new_call_id(), function=ResponseFunction(name=function, arguments=""))
        self.calls.append(call)
        self._call_deltas[len(self.calls) - 1] = {"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                                  "function": {"name": function, "arguments": ""}}

    def take_call_deltas(self) -> list[dict]:
        """The calls' OpenAI stream deltas since the last take: a call's first one with its index,
        id, type and name, then `arguments` fragments (one delta per call)."""
        deltas, self._call_deltas = list(self._call_deltas.values()), {}
        return deltas

    def count_tokens(self, tokenizer: Any) -> int:
        """reasoning_tokens once the output is complete: the thinking text's tokens."""
        return len(tokenizer.encode(self.reasoning, add_special_tokens=False)) if self.reasoning else 0

    def message_fields(self) -> tuple[str | None, str | None]:
        """(reasoning, content) of the whole message: None for a part the output lacks (an output of
        nothing at all is an empty answer)."""
        reasoning = self.reasoning if self.entered else None
        content = self.content if self.content or (reasoning is None and not self.calls) else None
        return reasoning, content
