"""A Responses request as the chat request it amounts to (server/chat_generation.py then decides
the prompt, sampling, grammar, tools and reasoning, as for /v1/chat/completions), the 400s for
what a stateless server cannot honour, and the chat field names in errors put back into the
Responses request's own."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from graphserve.engine.errors import InvalidRequestError
from graphserve.server.errors import APIError, bad_request, from_engine_error, from_validation_errors
from graphserve.server.protocol import ChatCompletionRequest, SamplerFields
from graphserve.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ReasoningInputItem,
    ResponsesRequest,
    UnsupportedItem,
    UnsupportedPart,
)

_NOT_KEPT = "this server keeps no responses or conversations (it is stateless): send the whole conversation in `input`"

# a chat field named in an error -> the Responses field it came from
_RESPONSES_PARAM = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
                    "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
_RESPONSES_WORDS = {"max_tokens": "max_output_tokens", "response_format": "text.format"}  # in error messages


def check_supported(body: ResponsesRequest) -> None:
    """400 naming the first field given that this server cannot honour."""
    refusals = [
        ("previous_response_id", body.previous_response_id is not None, _NOT_KEPT),
        ("conversation", body.conversation is not None, _NOT_KEPT),
        ("prompt", body.prompt is not None, "stored prompt templates are not kept here: send the prompt in `input`"),
        ("background", bool(body.background), "background responses need a stored response; this server keeps none"),
        ("include", bool(body.include), "no additional output data (include) can be returned"),
        ("truncation", body.truncation == "auto",
         "the input is never truncated: one that does not fit the context is a 400"),
        ("max_tool_calls", body.max_tool_calls is not None, "max_tool_calls is not supported"),
        ("top_logprobs", bool(body.top_logprobs), "logprobs are not returned by /v1/responses"),
        ("reasoning.summary", body.reasoning is not None and body.reasoning.summary is not None,
         "reasoning summaries are not written; the reasoning item carries the thinking itself"),
        ("reasoning.generate_summary", body.reasoning is not None and body.reasoning.generate_summary is not None,
         "reasoning summaries are not written; the reasoning item carries the thinking itself"),
    ]
    for param, refused, why in refusals:
        if refused:
            raise bad_request(f"{param}: {why}", param=param)
    for i, tool in enumerate(body.tools or []):
        if not isinstance(tool, FunctionTool):
            raise bad_request(f"tools.{i}: the built-in tool {tool.type!r} is not supported; only function tools are",
                              param=f"tools.{i}")
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str) and (choice.type != "function" or not choice.name):
        raise bad_request(f"tool_choice: {choice.type!r} is not supported; give auto, none, required or "
                          '{"type": "function", "name": ...}', param="tool_choice")


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation in chat's form: instructions first (a system message), function calls as
    the assistant's tool_calls, their outputs as tool messages; reasoning items left out."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        if isinstance(item, UnsupportedItem):
            raise bad_request(f"input.{i}: items of type {item.type!r} are not supported", param=f"input.{i}.type")
        if isinstance(item, ReasoningInputItem):
            continue
        if isinstance(item, MessageItem):
            for j, part in enumerate(item.content if isinstance(item.content, list) else []):
                if isinstance(part, UnsupportedPart):
                    raise bad_request(f"input.{i}.content.{j}: content of type {part.type!r} is not supported; "
                                      "only text", param=f"input.{i}.content.{j}.type")
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("text.format of type json_schema needs a schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.json_schema,
                                                    "description": fmt.description, "strict": fmt.strict}}


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request `body` amounts to (one choice, not streamed: the Responses route writes its
    own stream). Call check_supported first."""
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning is not None and body.reasoning.effort is not None:
        template_kwargs.setdefault("reasoning_effort", body.reasoning.effort)  # gpt-oss's template reads it
    choice = body.tool_choice
    fields: dict[str, Any] = {name: getattr(body, name) for name in SamplerFields.model_fields}
    fields |= {
        "model": body.model,
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "response_format": _response_format(body),
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in body.tools or [] if isinstance(t, FunctionTool)] or None,
        "tool_choice": choice if choice is None or isinstance(choice, str) else
        {"type": "function", "function": {"name": choice.name}},
        "parallel_tool_calls": body.parallel_tool_calls,
        "chat_template_kwargs": template_kwargs or None,
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise responses_error(from_validation_errors(list(exc.errors()))) from None


def responses_error(exc: Exception) -> Exception:
    """An error of the chat machinery with the Responses request's field names; others unchanged."""
    if isinstance(exc, InvalidRequestError):
        exc = from_engine_error(exc)
    if not isinstance(exc, APIError):
        return exc
    message, param = exc.message, exc.param
    for chat_word, word in _RESPONSES_WORDS.items():
        message = message.replace(chat_word, word)
    if param is not None:
        head, dot, rest = param.partition(".")
        param = _RESPONSES_PARAM.get(head, head) + dot + rest
    return APIError(exc.status_code, message, type=exc.type, param=param, code=exc.code, headers=exc.headers)
