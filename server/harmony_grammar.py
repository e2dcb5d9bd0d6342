"""The tool-call grammar of a gpt-oss output (harmony's messages, server/harmony.py reads them): an
xgrammar structural tag. Before its last message the model may write any number of analysis
messages (its thinking) and commentary messages without a recipient (preambles to the user), each
`<|channel|>CHANNEL<|message|>TEXT<|end|>` then `<|start|>assistant`. The last message is a call of
one of the tools, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`
(ARGS valid against the tool's parameters; the recipient may also follow the role, as gpt-oss's
template renders past calls, and the content type may be written without `<|constrain|>` or left
out), or with tool_choice "auto" the answer, `<|channel|>final<|message|>TEXT<|return|>` (a content
type allowed there too). `<|call|>` and `<|return|>` are gpt-oss's stop tokens, so an output holds
one call at most (parallel_tool_calls changes nothing).

Written here rather than taken from xgrammar's "harmony" builder, which allows no preamble, no
content type on the answer, and no space before a call's `<|constrain|>`, all of which gpt-oss writes."""

from __future__ import annotations

from typing import Any

from graphserve.engine.structured.grammar import HARMONY_FINAL, HARMONY_HEADER_END

NEXT_MESSAGE = "<|start|>assistant"


def harmony_tool_tag(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], max_whitespace: int):
    """The structural tag of an output that may call `tools` (OpenAI function tools, each with its
    parameters' schema) under `tool_choice` ("auto", "required", or a named function);
    `max_whitespace`: the longest run of whitespace inside the arguments."""
    from xgrammar import structural_tag as st

    def message(begin: str, end: str):
        return st.TagFormat(begin=begin, content=st.AnyTextFormat(), end=end)

    def after_header(content):  # the header's content type, <|message|>, then `content`
        return st.SequenceFormat(elements=[st.GrammarFormat(grammar=HARMONY_HEADER_END), content])

    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    last = [st.TagFormat(begin=begin, end="<|call|>", content=after_header(st.JSONSchemaFormat(
                json_schema=tool["function"]["parameters"], max_whitespace_cnt=max_whitespace)))
            for tool in tools if named in (None, tool["function"]["name"])
            for recipient in [f"to=functions.{tool['function']['name']}"]
            for begin in (f"<|channel|>commentary {recipient}", f" {recipient}<|channel|>commentary")]
    if tool_choice == "auto":
        last.append(st.TagFormat(begin=HARMONY_FINAL, content=after_header(st.AnyTextFormat()), end="<|return|>"))
    before = st.SequenceFormat(elements=[
        st.OrFormat(elements=[message("<|channel|>analysis<|message|>", "<|end|>"),
                              message("<|channel|>commentary<|message|>", "<|end|>")]),
        st.ConstStringFormat(value=NEXT_MESSAGE)])
    return st.StructuralTag(format=st.SequenceFormat(elements=[st.StarFormat(content=before),
                                                               st.OrFormat(elements=last)]))
