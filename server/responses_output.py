"""A choice's parts (server/choice_parts.py), update by update, as the Responses API's output
items and the stream events that build them: a reasoning item (the thinking), a message (the
answer's text), a function_call per tool call, in the order the model wrote them.

A non-streamed response runs the same builder over the whole output and keeps its items, so the
streamed response.completed and the plain response hold the same output. Whitespace the answer
starts with opens no message on its own (it waits for text; before a tool call it is dropped,
as chat drops it)."""

from __future__ import annotations

import secrets
from typing import Any

from graphserve.server.choice_parts import OutputParts
from graphserve.server.responses_protocol import (
    FunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
)

Event = dict[str, Any]  # one stream event, without its sequence_number (the stream numbers them)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._text = ""  # the open item's text (thinking, answer or arguments) so far
        self._leading_space = ""  # the answer's whitespace, held until text follows

    def feed(self, parts: OutputParts) -> list[Event]:
        events: list[Event] = []
        if parts.reasoning:
            if not isinstance(self._open, ReasoningItem):
                events += self._start(ReasoningItem(id=new_item_id("rs")), ReasoningText(text=""))
            events.append(self._delta("response.reasoning_text.delta", parts.reasoning, content_index=0))
        if parts.content:
            if isinstance(self._open, OutputMessage):
                events.append(self._delta("response.output_text.delta", parts.content, content_index=0, logprobs=[]))
            elif not (self._leading_space + parts.content).strip():
                self._leading_space += parts.content
            else:
                text, self._leading_space = self._leading_space + parts.content, ""
                events += self._start(OutputMessage(id=new_item_id("msg")), OutputText(text=""))
                events.append(self._delta("response.output_text.delta", text, content_index=0, logprobs=[]))
        for call in parts.tool_calls:
            if "id" in call:  # a call opens: its name is known (server/tools.py's deltas)
                self._leading_space = ""
                events += self._start(FunctionCall(id=new_item_id("fc"), call_id=call["id"],
                                                   name=call["function"]["name"]))
            arguments = call["function"].get("arguments", "")
            if arguments:
                events.append(self._delta("response.function_call_arguments.delta", arguments))
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """The last item's closing events; `incomplete`: the output was cut (max_output_tokens)."""
        return self._close("incomplete" if incomplete else "completed")

    def _start(self, item: OutputItem, part: OutputText | ReasoningText | None = None) -> list[Event]:
        events = self._close("completed")
        self.items.append(item)
        self._open, self._text = item, ""
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": item.model_dump()})
        if part is not None:
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": part.model_dump()})
        return events

    def _delta(self, kind: str, delta: str, **fields: Any) -> Event:
        self._text += delta
        return {"type": kind, **self._where(), **fields, "delta": delta}

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.items) - 1}

    def _close(self, status: str) -> list[Event]:
        item, text = self._open, self._text
        if item is None:
            return []
        where = self._where()
        item.status = status  # type: ignore[assignment]
        events: list[Event]
        if isinstance(item, ReasoningItem):
            part = ReasoningText(text=text)
            item.content = [part]
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part.model_dump()}]
        elif isinstance(item, OutputMessage):
            part = OutputText(text=text)
            item.content = [part]
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part.model_dump()}]
        else:
            item.arguments = text
            events = [{"type": "response.function_call_arguments.done", **where, "arguments": text}]
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": item.model_dump()})
        self._open, self._text = None, ""
        return events
