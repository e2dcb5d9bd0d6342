"""Pydantic models of the OpenAI-compatible response bodies the server sends (its errors' included)."""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


def _now() -> int:
    return int(time.time())


# return_token_ids' response fields: left out of the JSON unless asked for (never `null`)
OptionalTokenIds = Annotated[list[int] | None, Field(default=None, exclude_if=lambda v: v is None)]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # output tokens of the thinking (a reasoning parser is on)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # only with --reasoning-parser (left out otherwise)
    completion_tokens_details: Annotated[CompletionTokensDetails | None,
                                         Field(default=None, exclude_if=lambda v: v is None)] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # return_token_ids only (left out otherwise); a stream sends prompt_token_ids in a choice's first chunk
    prompt_token_ids: OptionalTokenIds = None
    token_ids: OptionalTokenIds = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


def new_call_id() -> str:
    """A tool call's id, in OpenAI's form."""
    return "call_" + secrets.token_hex(12)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # left out of the JSON when the request had no tools
    tool_calls: Annotated[list[ResponseToolCall] | None, Field(default=None, exclude_if=lambda v: v is None)] = None
    # --reasoning-parser: the thinking, under both names vLLM sends (left out otherwise)
    reasoning_content: Annotated[str | None, Field(default=None, exclude_if=lambda v: v is None)] = None
    reasoning: Annotated[str | None, Field(default=None, exclude_if=lambda v: v is None)] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: OptionalTokenIds = None  # return_token_ids only


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: OptionalTokenIds = None  # return_token_ids only


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": "..."} and/or {"tool_calls": [...]}
    delta: dict[str, Any]
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: OptionalTokenIds = None  # return_token_ids only: this chunk's generated ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: OptionalTokenIds = None  # return_token_ids only, in a choice's first chunk


class CompletionChunk(CompletionResponse):
    """A streamed completions event: the full response's fields, `object` included
    ("text_completion", as OpenAI sends for chunks too)."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the server returns: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "graphserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
