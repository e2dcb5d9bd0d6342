"""POST /v1/chat/completions: messages through the model's chat template, n choices."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from graphserve.server import openapi
from graphserve.server.auth import require_api_key
from graphserve.server.chat_generation import prepare_chat
from graphserve.server.choice_parts import ChoiceParser
from graphserve.server.generation import ChoiceJob, ChoiceProgress, GenerationGroup, start_generation
from graphserve.server.logprobs import chat_logprobs
from graphserve.server.protocol import ChatCompletionRequest
from graphserve.server.response_bodies import (
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionTokensDetails,
    UsageInfo,
)
from graphserve.server.reasoning import ReasoningConfig
from graphserve.server.request_body import parse_body
from graphserve.server.request_params import for_choice
from graphserve.server.response_view import ResponseView
from graphserve.server.state import ServerState, get_state, new_request_id
from graphserve.server.tools import HARMONY, CallFormat, finish_reason_with_calls, parse_tool_calls

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    dependencies=[Depends(require_api_key)],
    response_model=None,
    openapi_extra=openapi.request_body(
        ChatCompletionRequest, example={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}),
    responses=openapi.responses(ChatCompletionResponse, streams=True),
)
async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, ChatCompletionRequest)
    engine = state.ready_engine(body.model)
    lora = state.adapter(body.model)  # now: an adapter unloaded while the prompt renders still serves this request
    chat = await prepare_chat(state, engine, body)
    jobs = [ChoiceJob(index=c, prompt=chat.prompt_ids, params=for_choice(chat.params, c), lora=lora)
            for c in range(body.n)]
    request_id = new_request_id("chatcmpl")
    group = await start_generation(state, request_id, jobs, stream=body.stream)
    return await _ChatView(state, body, request_id, chat.tools, chat.reasoning).respond(request, group)


class _ChatView(ResponseView):
    """A chat choice: a message (tool calls parsed out of its text when the request may call
    tools); streamed, the role first, then content and tool-call deltas."""

    chunk_type = ChatCompletionChunk

    def __init__(self, state: ServerState, body: ChatCompletionRequest, request_id: str, tools: CallFormat | None,
                 reasoning: ReasoningConfig | None = None):
        super().__init__(state, body, request_id)
        self.tools = tools  # the call format to parse, when the request may call tools
        self.reasoning = reasoning  # --reasoning-parser: each choice's thinking split from its answer
        self.num_top = body.top_logprobs or 0

    def usage(self, progress: dict[int, ChoiceProgress]) -> UsageInfo:
        usage = super().usage(progress)
        if self.reasoning is not None:
            tokens = sum(s.count_tokens(self.tokenizer) for s in self.reasoning.splitters.values())
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=tokens)
        return usage

    def _logprobs(self, entries: list[Any] | None) -> ChatChoiceLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatChoiceLogprobs(content=chat_logprobs(entries or [], self.tokenizer.token_text, self.num_top))

    def response(self, progress: dict[int, ChoiceProgress]) -> ChatCompletionResponse:
        choices = []
        for index, output in self.final_outputs(progress):
            text, thinking = output.text, {}
            if self.reasoning is not None:  # the thinking apart; tool calls only from the answer
                splitter = self.reasoning.splitter(index)
                splitter.feed(output.text, output.token_ids)
                splitter.finish()
                reasoning, text = splitter.message_fields()
                thinking = {"reasoning_content": reasoning, "reasoning": reasoning}
            message, finish_reason = ChatResponseMessage(content=text, **thinking), output.finish_reason
            if self.tools is not None:
                if self.tools is HARMONY:  # harmony's calls are messages of their own, read by its splitter
                    content, calls = text, self.reasoning.splitter(index).calls  # type: ignore[union-attr]
                else:
                    content, calls = parse_tool_calls(self.tools, text or "")
                message = ChatResponseMessage(content=content, tool_calls=calls or None, **thinking)
                finish_reason = finish_reason_with_calls(finish_reason, bool(calls))
            choices.append(
                ChatCompletionChoice(
                    index=index,
                    message=message,
                    logprobs=self._logprobs(output.logprobs),
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason,
                    token_ids=output.token_ids if self.body.return_token_ids else None,
                )
            )
        prompt_ids = None
        if self.body.return_token_ids and progress:
            prompt_ids = progress[min(progress)].output.prompt_token_ids  # type: ignore[union-attr]
        return ChatCompletionResponse(**self.head(), choices=choices, usage=self.usage(progress),
                                      prompt_token_ids=prompt_ids)

    async def choice_events(self, group: GenerationGroup) -> AsyncIterator[bytes]:
        started: set[int] = set()
        with_ids = self.body.return_token_ids
        parsers: dict[int, ChoiceParser] = {}
        async for index, output in group.outputs():
            if index not in started:
                started.add(index)
                # return_token_ids: the prompt's ids in each choice's first chunk, as vLLM
                yield self.chunk(ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""}),
                                 prompt_token_ids=output.prompt_token_ids if with_ids else None)
            parser = parsers.setdefault(index, ChoiceParser(index, self.reasoning, self.tools))
            parts = parser.feed(output)
            thinking = parts.reasoning
            delta = ({"reasoning_content": thinking, "reasoning": thinking} if thinking else {}) | (
                {"content": parts.content} if parts.content else {}) | (
                {"tool_calls": parts.tool_calls} if parts.tool_calls else {})
            finish_reason = output.finish_reason if output.finished else None
            if self.tools is not None and output.finished:
                finish_reason = finish_reason_with_calls(finish_reason, parser.has_calls)
            has_logprobs = bool(self.body.logprobs and output.logprobs)
            if not self.has_news(output, content=bool(delta), logprobs=has_logprobs):
                continue
            yield self.chunk(
                ChatChunkChoice(
                    index=index,
                    delta=delta,
                    logprobs=self._logprobs(output.logprobs),
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason if output.finished else None,
                    token_ids=list(output.token_ids) if with_ids else None,
                )
            )
