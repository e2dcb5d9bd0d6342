"""Reasoning parsers (`--reasoning-parser`): a reasoning model's thinking, written between
`<think>` and `</think>`, is split from its answer. The chat route sends the thinking as
`reasoning_content` (and `reasoning`, the newer name vLLM also sends) and the rest as
`content`, whole or as streamed deltas (a tag split across stream chunks is held back until
it is clear).

As vLLM's parsers of the same names:
- "qwen3": the model opens `<think>` itself; an output without the tags is all answer
  (`enable_thinking: false`, or a model that did not think). An opened `<think>` that is
  never closed (the output ran into max_tokens) is all thinking. When the prompt itself
  ends in an open `<think>` (Qwen3 "thinking" templates) the output starts inside it.
- "deepseek-r1": the template already opened `<think>`, so the output starts inside the
  thinking (a `<think>` the model writes again at its start is dropped); everything up to
  `</think>` is thinking, and an output that never closes it is all thinking.
- "gpt-oss": harmony's channels (server/harmony.py): analysis is the thinking, final the answer.

Left to "auto" (the default), the parser is chosen from the chat template when it is
unambiguous (`parser_for_template`); "none" turns it off.

`reasoning_tokens`: the output tokens inside the thinking (the tags excluded), counted on
the token ids when the tags are single tokens, else by tokenizing the thinking text."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgspec

from graphserve.engine.request import SamplingParams
from graphserve.server.harmony import HarmonySplitter, is_harmony_template

THINK_START = "<think>"
THINK_END = "</think>"

REASONING_PARSERS = ("qwen3", "deepseek-r1", "gpt-oss")
AUTO, OFF = "auto", "none"  # the parser from the chat template; no parser
_ALIASES = {"deepseek_r1": "deepseek-r1", "gpt_oss": "gpt-oss", "openai_gptoss": "gpt-oss"}

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def parser_name(name: str | None) -> str:
    """The canonical setting: a parser, "auto" (None or empty: the default) or "none" (vLLM's
    spellings "deepseek_r1" and "openai_gptoss" are accepted); ValueError naming the choices for
    an unknown one."""
    if name is None or name == "":
        return AUTO
    canonical = _ALIASES.get(name, name)
    if canonical not in (*REASONING_PARSERS, AUTO, OFF):
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: "
                         f"{', '.join(REASONING_PARSERS)}, {AUTO}, {OFF}")
    return canonical


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template implies, or None when it shows no thinking markers: harmony's
    `<|channel|>` -> gpt-oss; `<think>` -> qwen3, which reads the rendered prompt (the output starts
    inside the thinking when the prompt opens it, as Qwen3-Thinking, QwQ, DeepSeek-R1's later
    templates and DeepSeek-V3.1's thinking mode render it; as answer when the prompt closes it);
    only `</think>` (DeepSeek-R1's first template strips it from past answers, its model opens the
    thinking without a tag) -> deepseek-r1."""
    template = chat_template or ""
    if is_harmony_template(template):
        return "gpt-oss"
    if THINK_START in template:
        return "qwen3"
    return "deepseek-r1" if THINK_END in template else None


def resolve_parser(setting: str, chat_template: str | None) -> tuple[str | None, str]:
    """(the parser to use, a log line saying why) for the `--reasoning-parser` setting."""
    if setting == OFF:
        return None, "reasoning parser: none (--reasoning-parser none)"
    if setting != AUTO:
        return setting, f"reasoning parser: {setting}"
    chosen = parser_for_template(chat_template)
    if chosen is None:
        return None, "reasoning parser: none (the chat template shows no thinking markers)"
    return chosen, f"reasoning parser: {chosen} (from the chat template; --reasoning-parser none turns it off)"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an opened `<think>` (the model's output starts in
    its thinking)."""
    return prompt_text.rstrip().endswith(THINK_START)


def _tail_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back: the
    next chunk may complete the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ReasoningSplitter:
    """One choice's output, fed text piece by piece: what is new thinking and what is new
    answer. Feeding the whole text once gives the same split as any piecewise feeding."""

    parser: str
    starts_inside: bool = False  # the prompt ends in an open <think> (qwen3)
    start_id: int | None = None  # the tags' token ids, when they are single tokens
    end_id: int | None = None
    reasoning: str = ""
    content: str = ""
    reasoning_tokens: int = 0
    entered: bool = False  # the output had a thinking part (possibly empty)
    _state: str = _START
    _token_state: str = _START
    _pending: str = ""

    def __post_init__(self) -> None:
        if self.parser == "deepseek-r1" or self.starts_inside:
            self.entered = True  # a leading <think> is still dropped in the _START state
        self._token_state = _REASONING if self.entered else _START

    def feed(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> tuple[str, str]:
        """(new thinking text, new answer text) after `text` (and its token ids)."""
        self._count(token_ids)
        self._pending += text
        reasoning, content = "", ""
        while self._pending:
            if self._state == _START:
                head = self._pending.lstrip()
                if head.startswith(THINK_START):
                    self._pending = head[len(THINK_START):]
                    self._state, self.entered = _REASONING, True
                    continue
                if THINK_START.startswith(head):  # whitespace, or a start of the tag: wait
                    break
                self._state = _REASONING if self.entered else _CONTENT
                continue
            if self._state == _REASONING:
                at = self._pending.find(THINK_END)
                if at >= 0:
                    reasoning += self._pending[:at]
                    self._pending = self._pending[at + len(THINK_END):]
                    self._state = _CONTENT
                    continue
                keep = _tail_prefix(self._pending, THINK_END)
                reasoning += self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                break
            content += self._pending
            self._pending = ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """At the end of the output: text held back is thinking inside an open thinking part,
        else answer."""
        leftover, self._pending = self._pending, ""
        if self._state == _REASONING or (self._state == _START and self.entered):
            self.reasoning += leftover
            return leftover, ""
        self.content += leftover
        return "", leftover

    def _count(self, token_ids: Any) -> None:
        if self.end_id is None:
            return
        for token_id in token_ids:
            if self._token_state == _REASONING:
                if token_id == self.end_id:
                    self._token_state = _CONTENT
                elif token_id != self.start_id:
                    self.reasoning_tokens += 1
            elif self._token_state == _START and token_id == self.start_id:
                self._token_state = _REASONING

    def count_tokens(self, tokenizer: Any) -> int:
        """reasoning_tokens once the output is complete."""
        if self.end_id is not None:
            return self.reasoning_tokens
        return len(tokenizer.encode(self.reasoning, add_special_tokens=False)) if self.reasoning else 0

    def message_fields(self) -> tuple[str | None, str | None]:
        """(reasoning, content) of the whole message: None for a part the output lacks."""
        reasoning = self.reasoning if self.entered else None
        content = self.content if self.content or reasoning is None else None
        return reasoning, content


@dataclass
class ReasoningConfig:
    """What a chat request's choices need to split their outputs."""

    parser: str
    start_id: int | None = None
    end_id: int | None = None
    starts_inside: bool = False
    prompt_closed: bool = False  # the prompt ends right after a </think> (enable_thinking=false)
    splitters: dict[int, ReasoningSplitter | HarmonySplitter] = field(default_factory=dict)

    @property
    def grammar_mode(self) -> str:
        """GrammarSpec.reasoning: where a response_format or tool grammar starts."""
        if self.starts_inside:
            return "inside"
        return "" if self.prompt_closed else "may_open"

    def adjust(self, params: SamplingParams) -> SamplingParams:
        """The request's params with this parser's needs: a grammar that leaves the thinking free,
        and (gpt-oss) harmony's markers kept in the text, where the parser (and the grammar) reads them.
        A harmony tool grammar (reasoning "harmony_messages") holds the thinking already."""
        changes: dict[str, Any] = {}
        if self.parser == "gpt-oss":
            changes["skip_special_tokens"] = False
            if params.grammar is not None and params.grammar.reasoning != "harmony_messages":
                changes["grammar"] = msgspec.structs.replace(params.grammar, reasoning="harmony")
        elif params.grammar is not None:
            changes["grammar"] = msgspec.structs.replace(params.grammar, reasoning=self.grammar_mode)
        return dataclasses.replace(params, **changes) if changes else params

    def splitter(self, index: int) -> ReasoningSplitter | HarmonySplitter:
        if index not in self.splitters:
            self.splitters[index] = (HarmonySplitter() if self.parser == "gpt-oss" else
                                     ReasoningSplitter(self.parser, self.starts_inside, self.start_id, self.end_id))
        return self.splitters[index]


def _single_token(tokenizer: Any, text: str) -> int | None:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001
        return None
    return ids[0] if len(ids) == 1 else None


def reasoning_config(parser: str | None, tokenizer: Any, prompt_ids: list[int]) -> ReasoningConfig | None:
    """The request's splitting setup, or None when no parser is on."""
    if parser is None:
        return None
    if parser == "gpt-oss":
        return ReasoningConfig(parser)
    start_id, end_id = _single_token(tokenizer, THINK_START), _single_token(tokenizer, THINK_END)
    if start_id is None or end_id is None:
        start_id = end_id = None
    tail = tokenizer.decode(list(prompt_ids[-16:]), skip_special_tokens=False) if prompt_ids else ""
    starts_inside = parser == "deepseek-r1" or prompt_opens_thinking(tail)
    closed = tail.rstrip().endswith(THINK_END)
    return ReasoningConfig(parser, start_id, end_id, starts_inside, prompt_closed=closed)
