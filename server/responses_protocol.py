"""Pydantic models of POST /v1/responses: the request (every field it takes; any other is a 400
naming it) and the response with its output items, in the shapes of OpenAI's Responses API.

A field OpenAI defines that this stateless server cannot honour is declared here and refused in
server/responses_input.py with a message saying why (stored responses and conversations,
background runs, built-in tools, ...); one nobody defines is refused by pydantic (`extra="forbid"`).
Input items that a client copies back from an earlier response (`response.output`) carry every
field those items have, so they are accepted as they come."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from graphserve.engine.request import MAX_TOKEN_COUNT
from graphserve.server.protocol import (
    MAX_CHAT_MESSAGES,
    MAX_CHAT_TEMPLATE_KWARGS,
    MAX_TOOLS,
    TOOL_NAME_PATTERN,
    SamplerFields,
)

MAX_METADATA_ENTRIES = 16  # as OpenAI

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Known(BaseModel):
    """A field it does not define is a 400 naming it, unless its value is null (what a client that
    dumps OpenAI's types with every field, e.g. `item.model_dump()`, sends for those it does not use)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_null_unknowns(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return {key: value for key, value in data.items() if value is not None or key in known}


class _Strict(_Known):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _tag(name: str) -> Tag:
    """A union member's tag, bracketed: pydantic puts it into an error's location, and
    errors.from_validation_errors leaves bracketed parts out of the field it names."""
    return Tag(f"type[{name}]")


# ---- the request ---------------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputTextPart(_Strict):
    """An assistant message's text, as an earlier response returned it."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class UnsupportedPart(BaseModel):
    """input_image, input_file, input_audio, refusal ...: named in a 400 (responses_input.py)."""

    model_config = ConfigDict(extra="allow")
    type: str


def _part_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type[{kind if kind in ('input_text', 'output_text') else 'other'}]"


ContentPart = Annotated[
    Annotated[InputText, _tag("input_text")] | Annotated[OutputTextPart, _tag("output_text")]
    | Annotated[UnsupportedPart, _tag("other")],
    Discriminator(_part_type),
]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if not isinstance(part, UnsupportedPart))


class FunctionCallItem(_Strict):
    """A call the model made earlier (a function_call output item, sent back with its result)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Strict):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output if not isinstance(part, UnsupportedPart))


class ReasoningInputItem(_Strict):
    """An earlier response's reasoning item: accepted, and left out of the prompt (as the chat
    route leaves out past thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


class UnsupportedItem(BaseModel):
    """Any other item type (item_reference, web_search_call, ...): named in a 400."""

    model_config = ConfigDict(extra="allow")
    type: str


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return f"type[{kind if kind in ('message', 'function_call', 'function_call_output', 'reasoning') else 'other'}]"


InputItem = Annotated[
    Annotated[MessageItem, _tag("message")] | Annotated[FunctionCallItem, _tag("function_call")]
    | Annotated[FunctionCallOutputItem, _tag("function_call_output")]
    | Annotated[ReasoningInputItem, _tag("reasoning")] | Annotated[UnsupportedItem, _tag("other")],
    Discriminator(_item_type),
]


def _input_type(value: Any) -> str:
    return "type[text]" if isinstance(value, str) else "type[items]"


Input = Annotated[
    Annotated[str, _tag("text")]
    | Annotated[Annotated[list[InputItem], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)], _tag("items")],
    Discriminator(_input_type),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class OtherTool(BaseModel):
    """A built-in tool (web_search, file_search, code_interpreter, computer_use, mcp, ...): named in a 400."""

    model_config = ConfigDict(extra="allow")
    type: str


def _tool_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "type[function]" if kind == "function" else "type[other]"


Tool = Annotated[Annotated[FunctionTool, _tag("function")] | Annotated[OtherTool, _tag("other")],
                 Discriminator(_tool_type)]


class FunctionToolChoice(_Known):
    """{"type": "function", "name": ...}; any other type (a built-in tool, allowed_tools) is a 400."""

    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None


class TextFormat(_Strict):
    """text.format: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)] | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model that was not trained for it honours


class ReasoningOptions(_Strict):
    """`effort` reaches the chat template as `reasoning_effort` (gpt-oss's reads it); summaries are
    not written (a 400 unless null)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(SamplerFields, _Known):
    """POST /v1/responses. Sampling: temperature and top_p (OpenAI's), and the extensions every
    route takes (top_k, min_p, seed, stop, the penalties); chat_template_kwargs as on chat."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_TOKEN_COUNT)] | None = None
    stream: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningOptions | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_CHAT_TEMPLATE_KWARGS)] | None = None
    # echoed back, nothing else
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA_ENTRIES)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # stateless: accepted whatever its value, nothing is kept (docs/responses.md)
    store: bool | None = None
    # OpenAI's, refused unless left out / at their no-op value (responses_input.check_supported)
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


# ---- the response --------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The thinking, as vLLM returns it: no summary, the text as reasoning_text content."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "in_progress"


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


OutputItem = OutputMessage | ReasoningItem | FunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cache_write_tokens: int = 0  # OpenAI bills cache writes apart; the prefix cache here has no such cost


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The response body (and what response.created / response.completed events carry)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    store: bool = False  # nothing is kept
    background: bool = False
