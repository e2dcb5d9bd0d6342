"""Tool calling on /v1/chat/completions: the call format a model speaks, the tools and past
calls in its prompt, the grammar that tool_choice implies, and the calls parsed back out
of its output, whole or as OpenAI's streamed deltas.

Formats (chosen from the chat template):
- "hermes" (Qwen2.5, Qwen3, and the fallback): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
- "llama3_json" (Llama 3.1+): `{"name": ..., "parameters": {...}}`
- "harmony" (gpt-oss): a message to `functions.NAME`, read by the gpt-oss reasoning parser
  (server/harmony.py), its grammar server/harmony_grammar.py's

A template that does not render tools itself (the embedded SmolLM2) gets FALLBACK_PROMPT,
a system message listing the tools, and speaks hermes. The grammar is xgrammar's
structural tag for the format: free text until a call opens, then a call of a given tool
with arguments valid against its schema ("auto"); at least one call ("required"); exactly
the named function (a named tool_choice)."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from graphserve.engine.structured.grammar import GrammarSpec
from graphserve.server.errors import bad_request
from graphserve.server.harmony import is_harmony_template
from graphserve.server.harmony_grammar import harmony_tool_tag
from graphserve.server.protocol import ChatCompletionRequest, ChatTool
from graphserve.server.response_bodies import ResponseFunction, ResponseToolCall, new_call_id


@dataclass(frozen=True)
class CallFormat:
    name: str
    xgrammar_model: str  # its structural-tag builder in xgrammar
    begin: str  # what opens a call in the output
    end: str  # what closes it after the JSON object
    arguments_key: str
    native: bool  # the chat template renders `tools` and tool messages itself


HERMES = CallFormat("hermes", "qwen_3", "<tool_call>", "</tool_call>", "arguments", native=True)
LLAMA3_JSON = CallFormat("llama3_json", "llama", '{"name"', "", "parameters", native=True)
FALLBACK = CallFormat("hermes", "qwen_3", "<tool_call>", "</tool_call>", "arguments", native=False)
# gpt-oss: calls are harmony messages of their own (server/harmony.py parses them, not ToolCallParser)
HARMONY = CallFormat("harmony", "", "", "<|call|>", "arguments", native=True)

MAX_ARGUMENT_WHITESPACE = 4  # characters in one run of whitespace inside a call's arguments (tool_grammar)

FALLBACK_PROMPT = """You can call functions. The functions you may call are listed in JSON below.
{tools}

To call a function, reply with one line per call, exactly in this form, and nothing else on that line:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>
The result of each call comes back in a message that starts with <tool_response>."""


@functools.lru_cache(maxsize=8)
def call_format(chat_template: str | None) -> CallFormat:
    template = chat_template or ""
    if is_harmony_template(template):
        return HARMONY
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3_JSON
    return FALLBACK


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # rendered as it came


def conversation(body: ChatCompletionRequest, fmt: CallFormat, with_tools: bool) -> tuple[list[dict], list | None]:
    """(messages for the chat template, `tools` for it): past tool calls and tool results
    in the form the template expects; for a fallback template the tools become a system
    message and calls/results plain text in the hermes form."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if with_tools else None
    messages = []
    for m in body.messages:
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            entry["name"] = m.name
        if m.tool_calls:
            if fmt.native:
                entry["tool_calls"] = [{"id": c.id, "type": "function",
                                        "function": {"name": c.function.name,
                                                     "arguments": _arguments_object(c.function.arguments)}}
                                       for c in m.tool_calls]
            else:
                calls = "\n".join(f'<tool_call>\n{{"name": {json.dumps(c.function.name)}, '
                                  f'"arguments": {c.function.arguments}}}\n</tool_call>' for c in m.tool_calls)
                entry["content"] = (entry["content"] + "\n" if entry["content"] else "") + calls
        if m.role == "tool":
            if m.tool_call_id:
                entry["tool_call_id"] = m.tool_call_id
            if not fmt.native:
                entry = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        messages.append(entry)
    if tools and not fmt.native:
        listing = "\n".join(json.dumps(t["function"]) for t in tools)
        system = {"role": "system", "content": FALLBACK_PROMPT.format(tools=listing)}
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + system["content"]}
        else:
            messages.insert(0, system)
        tools = None
    return messages, tools


def check_tool_request(body: ChatCompletionRequest) -> bool:
    """400 for a tool_choice that names no given tool or comes without tools; True when
    this request may call tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice is only allowed when tools are given", param="tool_choice")
        return False
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", param="tools")
    if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                          param="tool_choice")
    return choice != "none"


def tool_grammar(fmt: CallFormat, body: ChatCompletionRequest) -> GrammarSpec:
    """The structural tag of `body`'s tools and tool_choice in `fmt`."""
    import xgrammar as xgr

    choice = body.tool_choice or "auto"
    if not isinstance(choice, str):
        choice = choice.model_dump()
    tools = [_tool_for_grammar(t) for t in body.tools or []]
    if fmt is HARMONY:  # harmony's messages, the thinking among them
        tag = harmony_tool_tag(tools, choice, MAX_ARGUMENT_WHITESPACE)
        return GrammarSpec("structural_tag", tag.model_dump_json(), param="tools", reasoning="harmony_messages")
    try:
        tag = xgr.get_model_structural_tag(fmt.xgrammar_model, tools=tools, tool_choice=choice, reasoning="disabled",
                                           parallel_tool_calls=body.parallel_tool_calls)
    except Exception as exc:  # a schema xgrammar cannot take
        raise bad_request(f"the tools cannot be turned into a grammar: {exc}", param="tools") from None
    _bound_whitespace(tag.format)
    return GrammarSpec("structural_tag", tag.model_dump_json(), param="tools")


def _bound_whitespace(node: Any) -> None:
    """Each run of whitespace inside a call's arguments at most MAX_ARGUMENT_WHITESPACE long (xgrammar
    allows any by default, and a model that prefers a newline there would write newlines until
    max_tokens, never finishing the call)."""
    from xgrammar.structural_tag import JSONSchemaFormat

    if isinstance(node, JSONSchemaFormat):
        node.max_whitespace_cnt = MAX_ARGUMENT_WHITESPACE
        return
    for value in vars(node).values() if hasattr(node, "__dict__") else ():
        for child in value if isinstance(value, list) else [value]:
            if hasattr(child, "__dict__"):
                _bound_whitespace(child)


def _tool_for_grammar(tool: ChatTool) -> dict:
    function = tool.function.model_dump(exclude_none=True)
    function.setdefault("parameters", {"type": "object", "properties": {}})
    return {"type": "function", "function": function}


# ---- parsing the output ----------------------------------------------------------------------

# a call's opening up to its arguments object (matched once its "{" has arrived)
_NAME_THEN_ARGUMENTS = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_decoder = json.JSONDecoder()


@dataclass
class _Call:
    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallParser:
    """Splits a choice's output text, fed piece by piece, into content and tool calls, and
    says what is new in OpenAI's streamed form: content text, and per call a first delta
    with index, id, type and name, then `arguments` fragments. Text that might open a
    call is held back until it is clear. Feeding the whole text once gives the same calls."""

    fmt: CallFormat
    calls: list[_Call] = field(default_factory=list)
    _pending: str = ""  # text not classified yet
    _in_call: bool = False
    _call_text: str = ""  # the current call, from its opening (begin marker excluded for hermes)
    _args_start: int = -1  # where the arguments start in _call_text; -1 until the name is known
    _args_sent: int = 0  # characters of the arguments already emitted
    _args_done: bool = False
    content: str = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(new content, new tool-call deltas) after `text`."""
        self._pending += text
        content, deltas = "", []
        while self._pending:
            if not self._in_call:
                begin = self.fmt.begin
                at = self._pending.find(begin)
                if at < 0:  # keep back a tail that could be the start of `begin`
                    keep = next((k for k in range(min(len(begin) - 1, len(self._pending)), 0, -1)
                                 if begin.startswith(self._pending[-k:])), 0)
                    emit = self._pending[:len(self._pending) - keep]
                    content += emit
                    self._pending = self._pending[len(emit):]
                    break
                content += self._pending[:at]
                skip = len(begin) if self.fmt.end else 0  # llama: the opening is the JSON itself
                self._pending = self._pending[at + skip:]
                self._in_call, self._call_text, self._args_start, self._args_sent = True, "", -1, 0
                self._args_done = False
                continue
            self._call_text += self._pending
            self._pending = ""
            deltas += self._advance_call()
        self.content += content
        return content, _merge(deltas)

    def _advance_call(self) -> list[dict]:
        deltas = []
        text = self._call_text
        if self._args_start < 0:
            m = _NAME_THEN_ARGUMENTS.match(text)
            if m is None:
                return deltas
            call = _Call(len(self.calls), new_call_id(), json.loads(m.group(1)))
            self.calls.append(call)
            self._args_start = m.end()
            deltas.append({"index": call.index, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
        call = self.calls[-1]
        if not self._args_done:
            try:
                _, end = _decoder.raw_decode(text, self._args_start)
                self._args_done = True
            except ValueError:
                end = len(text)  # incomplete: all of it is arguments so far
            fragment = text[self._args_start + self._args_sent:end]
            if fragment:
                call.arguments += fragment
                self._args_sent += len(fragment)
                deltas.append({"index": call.index, "function": {"arguments": fragment}})
        if self._args_done:
            rest = text[self._args_start + self._args_sent:]
            closing = re.match(r"\s*\}\s*" + re.escape(self.fmt.end), rest)
            if closing is not None:  # the call is complete: what follows is text again
                self._in_call = False
                self._pending = rest[closing.end():]
        return deltas

    def finish(self) -> tuple[str, list[dict]]:
        """At the end of the output: text held back that never became a call is content."""
        leftover = self._pending if not self._in_call else ""
        if self._in_call and self._args_start < 0:  # an opening that never became a call
            leftover = self.fmt.begin * bool(self.fmt.end) + self._call_text
        self._pending = ""
        self.content += leftover
        return leftover, []

    def tool_calls(self) -> list[ResponseToolCall]:
        return [ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments))
                for c in self.calls]


def _merge(deltas: list[dict]) -> list[dict]:
    """One delta per call in a chunk: a call's opening and its first arguments together."""
    merged: dict[int, dict] = {}
    for delta in deltas:
        entry = merged.get(delta["index"])
        if entry is None:
            merged[delta["index"]] = {**delta, "function": dict(delta["function"])}
        else:
            entry["function"]["arguments"] = entry["function"].get("arguments", "") + delta["function"]["arguments"]
    return list(merged.values())


def parse_tool_calls(fmt: CallFormat, text: str) -> tuple[str | None, list[ResponseToolCall]]:
    """A whole output: (content or None when it is only whitespace, the calls)."""
    parser = ToolCallParser(fmt)
    parser.feed(text)
    parser.finish()
    content = parser.content if parser.content.strip() else None
    if parser.calls and content is not None:
        content = content.strip()
    return content, parser.tool_calls()


def finish_reason_with_calls(finish_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI says "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason

