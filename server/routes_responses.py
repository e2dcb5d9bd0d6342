"""POST /v1/responses: OpenAI's Responses API, stateless. The request becomes a chat request
(server/responses_input.py), runs as one, and its output comes back as output items
(server/responses_output.py): the whole response, or the Responses event stream."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from graphserve.engine.errors import InvalidRequestError
from graphserve.server import openapi
from graphserve.server.auth import require_api_key
from graphserve.server.chat_generation import PreparedChat, prepare_chat
from graphserve.server.choice_parts import ChoiceParser
from graphserve.server.errors import APIError
from graphserve.server.generation import (
    ChoiceJob,
    ChoiceProgress,
    GenerationGroup,
    as_api_error,
    run_to_completion,
    start_generation,
)
from graphserve.server.request_body import parse_body
from graphserve.server.responses_input import chat_request, check_supported, responses_error
from graphserve.server.responses_output import Event, OutputBuilder
from graphserve.server.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from graphserve.server.sse import EventStreamResponse, json_response
from graphserve.server.state import ServerState, get_state

router = APIRouter()

_DOCUMENTED = openapi.responses(ResponseObject, streams=True)
_DOCUMENTED[200]["description"] = "The response, or with `stream: true` the Responses API's server-sent events."


@router.post(
    "/v1/responses",
    dependencies=[Depends(require_api_key)],
    response_model=None,
    openapi_extra=openapi.request_body(ResponsesRequest, example={"input": "Hello", "max_output_tokens": 8}),
    responses=_DOCUMENTED,
)
async def create_response(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, ResponsesRequest)
    engine = state.ready_engine(body.model)
    lora = state.adapter(body.model)  # now: an adapter unloaded while the prompt renders still serves it
    check_supported(body)
    request_id = f"resp_{uuid.uuid4().hex}"
    try:
        chat = await prepare_chat(state, engine, chat_request(body))
        job = ChoiceJob(0, chat.prompt_ids, chat.params, lora=lora)
        group = await start_generation(state, request_id, [job], stream=body.stream)
    except (APIError, InvalidRequestError) as exc:
        raise responses_error(exc) from None
    view = _ResponsesView(state, body, request_id, chat)
    if body.stream:
        return EventStreamResponse(view.events(group), on_close=group.close)
    progress = await run_to_completion(request, group)
    return json_response(view.response(progress))


class _ResponsesView:
    """The response of one request: its fields, then its output items as they are built."""

    def __init__(self, state: ServerState, body: ResponsesRequest, request_id: str, chat: PreparedChat):
        self.body = body
        self.chat = chat
        self.tokenizer = state.engine.tokenizer
        self.builder = OutputBuilder()
        self.parser = ChoiceParser(0, chat.reasoning, chat.tools)
        self.head = ResponseObject(
            id=request_id, created_at=int(time.time()), status="in_progress", model=state.response_model(body.model),
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls,
            reasoning=body.reasoning.model_dump() if body.reasoning is not None else None,
            temperature=body.temperature if body.temperature is not None else 1.0,  # OpenAI's defaults
            top_p=body.top_p if body.top_p is not None else 1.0,
            text={"format": _text_format(body)}, tool_choice=_tool_choice(body),
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
            metadata=body.metadata or {}, user=body.user, safety_identifier=body.safety_identifier,
            prompt_cache_key=body.prompt_cache_key,
        )

    def response(self, progress: dict[int, ChoiceProgress]) -> ResponseObject:
        """The whole response once the output has finished."""
        output = progress[0].output
        assert output is not None
        incomplete = output.finish_reason == "length"
        self.builder.feed(self.parser.feed(output))
        self.builder.finish(incomplete)
        return self._final_object(progress[0], incomplete)

    def _final_object(self, progress: ChoiceProgress, incomplete: bool) -> ResponseObject:
        splitter = self.chat.reasoning.splitter(0) if self.chat.reasoning is not None else None
        reasoning_tokens = splitter.count_tokens(self.tokenizer) if splitter is not None else 0
        usage = ResponseUsage(
            input_tokens=progress.num_prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=progress.num_cached_tokens),
            output_tokens=progress.num_output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=progress.num_prompt_tokens + progress.num_output_tokens,
        )
        return self.head.model_copy(update={
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
            "output": self.builder.items, "usage": usage})

    async def events(self, group: GenerationGroup) -> AsyncIterator[bytes]:
        """response.created, response.in_progress, the items' events as the output arrives, then
        response.completed (response.incomplete when max_output_tokens cut it). An error after the
        headers went out becomes a final `error` event; the group is always closed."""
        number = iter(range(1 << 62))
        try:
            yield _event({"type": "response.created", "response": self.head.model_dump()}, next(number))
            yield _event({"type": "response.in_progress", "response": self.head.model_dump()}, next(number))
            async for _, output in group.outputs():
                for event in self.builder.feed(self.parser.feed(output)):
                    yield _event(event, next(number))
                if output.finished:
                    incomplete = output.finish_reason == "length"
                    for event in self.builder.finish(incomplete):
                        yield _event(event, next(number))
                    final = self._final_object(group.progress[0], incomplete)
                    kind = "response.incomplete" if incomplete else "response.completed"
                    yield _event({"type": kind, "response": final.model_dump()}, next(number))
        except Exception as exc:  # noqa: BLE001  # the headers are out: any failure becomes the last event
            error = as_api_error(exc, self.head.id)
            yield _event({"type": "error", "code": error.code or error.type, "message": error.message,
                          "param": error.param}, next(number))
        finally:
            await group.close()


def _text_format(body: ResponsesRequest) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None else None
    return fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}


def _tool_choice(body: ResponsesRequest) -> str | dict[str, Any]:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)


def _event(event: Event, sequence_number: int) -> bytes:
    """One server-sent event as OpenAI writes them: its type as the SSE event name, then the JSON."""
    data: dict[str, Any] = {**event, "sequence_number": sequence_number}
    return (f"event: {event['type']}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":"))
            .encode("utf-8") + b"\n\n")
