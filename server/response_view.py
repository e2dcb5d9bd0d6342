"""What chat and completions responses share: the head, usage, and the SSE stream around the choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from graphserve.engine.request import RequestOutput
from graphserve.server.generation import ChoiceProgress, GenerationGroup, as_api_error, run_to_completion
from graphserve.server.protocol import ChatCompletionRequest, CompletionRequest
from graphserve.server.response_bodies import PromptTokensDetails, UsageInfo
from graphserve.server.sse import DONE_EVENT, EventStreamResponse, json_response, sse_event
from graphserve.server.state import ServerState


def usage_of(progress: dict[int, ChoiceProgress], n: int) -> UsageInfo:
    """Prompt tokens count once per prompt (choices p*n .. p*n+n-1 share it)."""
    prompt_tokens = sum(p.num_prompt_tokens for i, p in progress.items() if i % n == 0)
    cached_tokens = sum(p.num_cached_tokens for i, p in progress.items() if i % n == 0)
    completion_tokens = sum(p.num_output_tokens for p in progress.values())
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class ResponseView:
    """Builds the response of one request: the whole body once every choice has finished, or
    a stream of chunks. A subclass says what a choice looks like (`response`, `choice_events`);
    this class writes what every body and chunk carries (id, created, model), the usage, and
    the stream around the choices' chunks: the usage chunk when the client asked for it, then
    [DONE]; an error after the headers went out becomes the last event."""

    chunk_type: type[BaseModel]  # the model of one stream chunk (its fields: the head, choices, usage)

    def __init__(self, state: ServerState, body: CompletionRequest | ChatCompletionRequest, request_id: str):
        self.body = body
        self.request_id = request_id
        self.model = state.response_model(body.model)
        self.created = int(time.time())
        self.tokenizer = state.engine.tokenizer

    async def respond(self, request: Request, group: GenerationGroup) -> Response:
        """The stream of events, or (not streaming) the body once every choice has finished."""
        if self.body.stream:
            return EventStreamResponse(self.events(group), on_close=group.close)
        progress = await run_to_completion(request, group)
        return json_response(self.response(progress))

    def head(self) -> dict[str, Any]:
        """The fields every response body and chunk starts with."""
        return {"id": self.request_id, "created": self.created, "model": self.model}

    def usage(self, progress: dict[int, ChoiceProgress]) -> UsageInfo:
        return usage_of(progress, self.body.n)

    @staticmethod
    def final_outputs(progress: dict[int, ChoiceProgress]) -> Iterator[tuple[int, RequestOutput]]:
        """(choice index, whole output) of each finished choice, in choice order."""
        for index in sorted(progress):
            output = progress[index].output
            assert output is not None
            yield index, output

    def response(self, progress: dict[int, ChoiceProgress]) -> BaseModel:
        raise NotImplementedError

    def choice_events(self, group: GenerationGroup) -> AsyncIterator[bytes]:
        """One event per update of a choice that has something to show (`has_news`)."""
        raise NotImplementedError

    def has_news(self, output: RequestOutput, *, content: bool, logprobs: bool) -> bool:
        """Whether a choice's update is worth a chunk: it carries content, logprobs, token ids
        the client asked for, or the choice's end."""
        return content or output.finished or logprobs or bool(self.body.return_token_ids and output.token_ids)

    def chunk(self, choice: BaseModel, **fields: Any) -> bytes:
        """The event of one chunk holding `choice` (its usage left out unless the client asked for usage)."""
        chunk = self.chunk_type(**self.head(), choices=[choice], **fields)
        return sse_event(chunk, exclude=None if self.body.include_usage_in_stream else {"usage"})

    async def events(self, group: GenerationGroup) -> AsyncIterator[bytes]:
        """A stream's body: the choices' events, the usage chunk when asked, then [DONE]. An error
        after the headers went out becomes a final error event; the group is always closed."""
        try:
            async for event in self.choice_events(group):
                yield event
            if self.body.include_usage_in_stream:
                yield sse_event(self.chunk_type(**self.head(), choices=[], usage=self.usage(group.progress)))
            yield DONE_EVENT
        except Exception as exc:  # noqa: BLE001  # the headers are out: any failure becomes the last event
            yield sse_event(as_api_error(exc, self.request_id).body())
            yield DONE_EVENT
        finally:
            await group.close()
