"""POST /v1/chat/completions: messages through the model's chat template, n choices."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from graphserve.server import openapi
from graphserve.server.auth import require_api_key
from graphserve.server.chat_prompt import render_chat_prompt
from graphserve.server.structured_request import grammar_from_request
from graphserve.server.tools import (
    CallFormat,
    ToolCallParser,
    call_format,
    check_tool_request,
    conversation,
    finish_reason_with_calls,
    parse_tool_calls,
    tool_grammar,
)
from graphserve.server.errors import bad_request
from graphserve.server.generation import ChoiceJob, ChoiceProgress, GenerationGroup, start_generation
from graphserve.server.logprobs import chat_logprobs
from graphserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionTokensDetails,
    UsageInfo,
)
from graphserve.server.reasoning import ReasoningConfig, reasoning_config
from graphserve.server.request_body import parse_body
from graphserve.server.request_params import build_sampling_params, for_choice
from graphserve.server.response_view import ResponseView
from graphserve.server.state import ServerState, get_state, new_request_id

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
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    tokenizer = engine.tokenizer
    # the cheap checks first (the parameters, then n against the queue: 400 / 429), then the
    # template and the tokenizer, O(body size), off the event loop
    fmt = call_format(tokenizer.chat_template)
    use_tools = check_tool_request(body)
    grammar = grammar_from_request(body)
    if use_tools:
        if grammar is not None:
            raise bad_request("response_format (or a structured_outputs field) cannot be combined with tools",
                              param=grammar.param)
        grammar = tool_grammar(fmt, body)
    params = build_sampling_params(
        body,
        max_tokens=body.effective_max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=None,
        vocab_size=tokenizer.vocab_size,
        grammar=grammar,
    )
    state.admission.admit(body.n)
    messages, template_tools = conversation(body, fmt, use_tools)
    prompt_ids = await asyncio.to_thread(render_chat_prompt, tokenizer, messages, body.add_generation_prompt,
                                         state.chat_content_special_tokens, template_tools,
                                         body.chat_template_kwargs)
    if not prompt_ids:
        raise bad_request("messages render to an empty prompt", param="messages")
    reasoning = reasoning_config(state.reasoning_parser, tokenizer, prompt_ids)
    if grammar is not None and reasoning is not None:  # the grammar leaves the thinking free
        grammar = msgspec.structs.replace(grammar, reasoning=reasoning.grammar_mode)
        params = dataclasses.replace(params, grammar=grammar)
    if grammar is not None:  # a 400 for a grammar that fails or takes too long to compile
        await engine.check_grammar(grammar)
    jobs = [ChoiceJob(index=c, prompt=prompt_ids, params=for_choice(params, c)) for c in range(body.n)]
    request_id = new_request_id("chatcmpl")
    group = await start_generation(state, request_id, jobs, stream=body.stream)
    return await _ChatView(state, body, request_id, fmt if use_tools else None, reasoning).respond(request, group)


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
        parsers: dict[int, ToolCallParser] = {}
        async for index, output in group.outputs():
            if index not in started:
                started.add(index)
                # return_token_ids: the prompt's ids in each choice's first chunk, as vLLM
                yield self.chunk(ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""}),
                                 prompt_token_ids=output.prompt_token_ids if with_ids else None)
            text, thinking = output.text, ""
            if self.reasoning is not None:  # the thinking apart; tool calls only from the answer
                splitter = self.reasoning.splitter(index)
                thinking, text = splitter.feed(output.text, output.token_ids)
                if output.finished:
                    more_thinking, more_text = splitter.finish()
                    thinking, text = thinking + more_thinking, text + more_text
            delta: dict[str, Any] = {"reasoning_content": thinking, "reasoning": thinking} if thinking else {}
            if text:
                delta["content"] = text
            finish_reason = output.finish_reason if output.finished else None
            if self.tools is not None:
                parser = parsers.setdefault(index, ToolCallParser(self.tools))
                content, calls = parser.feed(text)
                if output.finished:
                    content += parser.finish()[0]
                    finish_reason = finish_reason_with_calls(finish_reason, bool(parser.calls))
                if parser.calls and not content.strip():
                    content = ""  # whitespace between calls is not content
                delta = ({"reasoning_content": thinking, "reasoning": thinking} if thinking else {}) | (
                    {"content": content} if content else {}) | ({"tool_calls": calls} if calls else {})
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
