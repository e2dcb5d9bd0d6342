"""Pydantic models of the OpenAI-compatible request bodies (the response bodies: server/response_bodies.py).

Range checks live here so that a bad value becomes a 400 naming the field; the
engine's SamplingParams re-checks what it needs. Every input is bounded before it costs
anything: integers to what the engine represents, floats finite (JSON `NaN` and
`Infinity`, which the parser accepts, are 400s), lists to the caps below and in
engine/request.py (each error message names its cap).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from graphserve.engine.request import (
    DEFAULT_MAX_TOKENS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_COUNT,
    SEED_MAX,
    SEED_MIN,
)

MAX_N = 128
MAX_PROMPTS = 2048  # entries of a prompt array (strings or token-id lists), as the OpenAI API
MAX_CHAT_MESSAGES = 4096
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # per assistant message
MAX_CHAT_TEMPLATE_KWARGS = 64  # entries of chat_template_kwargs
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_.-]{1,64}$"  # as OpenAI (dots allowed, as vLLM)

Prompt = str | list[int] | list[str] | list[list[int]]


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI clients send extras (e.g. `extra_body` ones).
    # NaN and +-Infinity (JSON literals the parser accepts, or 1e999) are rejected in every float field.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)] = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's extension (`structured_outputs`): exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SamplerFields(_Request):
    """The sampling knobs every generation route takes (completions, chat, responses)."""

    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKEN_COUNT)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY)] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(stop) > MAX_STOP_STRING_CHARS for stop in stops):
            raise ValueError(f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        return value


class _SamplingFields(SamplerFields):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)]] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension: each choice carries `token_ids` (the generated ids), and the prompt's ids
    # come back as `prompt_token_ids` (per choice in completions, per response in chat)
    return_token_ids: bool = False
    # constrained output (server/structured_request.py): OpenAI's response_format, vLLM's
    # structured_outputs, and vLLM's older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(value)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed, got {len(value)}")
        return value


PROMPT_JSON_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
    ]
}


class CompletionRequest(_SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(PROMPT_JSON_SCHEMA)]
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)] | None = DEFAULT_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: Any) -> Prompt:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
                return value  # one prompt of token ids (its length is checked against the context)
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed per request, got {len(value)}")
            if all(isinstance(x, str) for x in value):
                return value
            if all(
                isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in value
            ):
                return value
        raise ValueError("prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists")


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Request):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class MessageToolCall(_Request):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    # extra variables for the chat template (e.g. {"enable_thinking": false}), as vLLM
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_CHAT_TEMPLATE_KWARGS)] | None = None

    @property
    def effective_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens; None: as many as fit."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_CHAT_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class LoadLoraAdapterRequest(_Request):
    """POST /v1/load_lora_adapter, as vLLM's."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_inplace: bool = False  # replace an adapter already loaded under this name


class UnloadLoraAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter, as vLLM's."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None
