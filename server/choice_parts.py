"""One choice's output, update by update, in its parts: the thinking (a reasoning parser is on),
the answer's text, and the tool calls parsed from the answer (the request may call tools). The
chat stream and the Responses API (streamed or not) read outputs through it."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphserve.engine.request import RequestOutput
from graphserve.server.reasoning import ReasoningConfig
from graphserve.server.tools import HARMONY, CallFormat, ToolCallParser


@dataclass
class OutputParts:
    """What one update added."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's streamed tool-call deltas (server/tools.py)


class ChoiceParser:
    """Feeding the updates one by one gives the same parts, concatenated, as feeding the whole
    output once (each parser holds back a marker split across updates until it is clear)."""

    def __init__(self, index: int, reasoning: ReasoningConfig | None, tools: CallFormat | None):
        self.splitter = reasoning.splitter(index) if reasoning is not None else None
        # harmony's calls are messages of their own, which its splitter reads (with harmony's tools the
        # gpt-oss parser is on: prepare_chat sees to it); other formats' are parsed from the answer
        self.harmony_calls = tools is HARMONY
        self.calls = ToolCallParser(tools) if tools is not None and not self.harmony_calls else None

    def feed(self, output: RequestOutput) -> OutputParts:
        thinking, text = "", output.text
        if self.splitter is not None:  # the thinking apart; tool calls only from the answer
            thinking, text = self.splitter.feed(output.text, output.token_ids)
            if output.finished:
                more_thinking, more_text = self.splitter.finish()
                thinking, text = thinking + more_thinking, text + more_text
        if self.harmony_calls:
            return OutputParts(thinking, text, self.splitter.take_call_deltas())  # type: ignore[union-attr]
        if self.calls is None:
            return OutputParts(thinking, text)
        content, calls = self.calls.feed(text)
        if output.finished:
            content += self.calls.finish()[0]
        if self.calls.calls and not content.strip():
            content = ""  # whitespace between calls is not content
        return OutputParts(thinking, content, calls)

    @property
    def has_calls(self) -> bool:
        if self.harmony_calls:
            return bool(self.splitter.calls)  # type: ignore[union-attr]
        return self.calls is not None and bool(self.calls.calls)
