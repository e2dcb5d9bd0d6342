"""POST /v1/completions: prompts (text or token ids) x n choices, streamed or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from graphserve.engine.request import RequestOutput
from graphserve.server import openapi
from graphserve.server.auth import require_api_key
from graphserve.server.errors import bad_request
from graphserve.server.generation import ChoiceJob, ChoiceProgress, GenerationGroup, start_generation
from graphserve.server.logprobs import append_completion_logprobs
from graphserve.server.protocol import CompletionRequest
from graphserve.server.response_bodies import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
)
from graphserve.server.request_body import parse_body
from graphserve.server.request_params import build_sampling_params, for_choice
from graphserve.server.response_view import ResponseView
from graphserve.server.state import ServerState, get_state, new_request_id
from graphserve.server.structured_request import grammar_from_request

router = APIRouter()


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    """One entry per prompt; an empty prompt is a 400. (The engine rejects out-of-vocabulary
    ids, against the model's vocabulary, with a 400 before anything is sent.)"""
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt must not be empty", param="prompt")
    for entry in prompts:
        if len(entry) == 0:
            raise bad_request("prompt must not be empty", param="prompt")
    return prompts


def tokenize_prompts(prompts: list[str | list[int]], tokenizer: Any) -> list[list[int]]:
    """Each text prompt tokenized once here (as the engine would) rather than once per choice
    by the engine; token ids pass as they are."""
    return [tokenizer.encode(prompt) if isinstance(prompt, str) else prompt for prompt in prompts]


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """Echo with logprobs scores the prompt; echo with max_tokens 0 and no logprobs still
    needs a scoring-only request (the engine allows max_tokens 0 only with prompt logprobs)."""
    if not body.echo:
        return None
    if body.logprobs is not None:
        return body.logprobs
    return 0 if body.max_tokens == 0 else None


@router.post(
    "/v1/completions",
    dependencies=[Depends(require_api_key)],
    response_model=None,
    openapi_extra=openapi.request_body(CompletionRequest, example={"prompt": "Hello", "max_tokens": 8}),
    responses=openapi.responses(CompletionResponse, streams=True),
)
async def create_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, CompletionRequest)
    engine = state.ready_engine(body.model)
    lora = state.adapter(body.model)  # now: an adapter unloaded while the prompt is tokenized still serves it
    tokenizer = engine.tokenizer
    prompts = normalize_prompts(body.prompt)
    # the cheap checks first: the parameters (a 400 even when the queue is full: they can never
    # be served), then prompts x n against the queue (400 / 429) before any costly work
    params = build_sampling_params(
        body,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=_prompt_logprobs(body),
        vocab_size=tokenizer.vocab_size,
        grammar=grammar_from_request(body),
    )
    state.admission.admit(len(prompts) * body.n)
    if params.grammar is not None:  # a 400 for a grammar that fails or takes too long to compile
        await engine.check_grammar(params.grammar)
    if any(isinstance(prompt, str) for prompt in prompts):
        # tokenizing is O(body size): off the event loop, so other clients keep being served
        prompt_ids = await asyncio.to_thread(tokenize_prompts, prompts, tokenizer)
    else:  # token ids: nothing to tokenize, and a thread hop costs a busy server milliseconds
        prompt_ids = tokenize_prompts(prompts, tokenizer)
    # max_tokens as the client gave it must fit after the prompt (else a 400); null is as many as
    # fit (as in vLLM); left out, the default (16) is clamped to what fits (engine/inputs.py)
    defaulted = "max_tokens" not in body.model_fields_set
    jobs = [
        ChoiceJob(index=p * body.n + c, prompt=ids, params=for_choice(params, c), max_tokens_defaulted=defaulted,
                  lora=lora)
        for p, ids in enumerate(prompt_ids)
        for c in range(body.n)
    ]
    request_id = new_request_id("cmpl")
    group = await start_generation(state, request_id, jobs, stream=body.stream)
    return await _CompletionView(state, body, prompts, request_id).respond(request, group)


class _CompletionView(ResponseView):
    """A completion choice: text (after the prompt's, with echo) and legacy logprobs."""

    chunk_type = CompletionChunk

    def __init__(self, state: ServerState, body: CompletionRequest, prompts: list[str | list[int]], request_id: str):
        super().__init__(state, body, request_id)
        self.prompts = prompts

    def prompt_text(self, index: int) -> str:
        prompt = self.prompts[index // self.body.n]
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt, skip_special_tokens=False)

    def response(self, progress: dict[int, ChoiceProgress]) -> CompletionResponse:
        choices = []
        for index, output in self.final_outputs(progress):
            text = output.text
            logprobs = None
            if self.body.logprobs is not None:
                logprobs, _ = self._logprobs(output, output.token_ids, 0, with_prompt=self.body.echo)
            if self.body.echo:
                text = self.prompt_text(index) + text
            choices.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                    prompt_token_ids=output.prompt_token_ids if self.body.return_token_ids else None,
                    token_ids=output.token_ids if self.body.return_token_ids else None,
                )
            )
        return CompletionResponse(**self.head(), choices=choices, usage=self.usage(progress))

    def _logprobs(self, output: RequestOutput, token_ids: list[int], offset: int,
                  with_prompt: bool) -> tuple[CompletionLogprobs, int]:
        """The logprobs of `token_ids` (whose text starts at `offset`), after the prompt's (from
        offset 0) when `with_prompt`; and the text offset after them."""
        logprobs = CompletionLogprobs()
        token_text = self.tokenizer.token_text
        if with_prompt:
            prompt_ids = output.prompt_token_ids
            entries = output.prompt_logprobs or [None] * len(prompt_ids)
            offset = append_completion_logprobs(logprobs, prompt_ids, entries, token_text, 0)
        return logprobs, append_completion_logprobs(logprobs, token_ids, output.logprobs or [], token_text, offset)

    async def choice_events(self, group: GenerationGroup) -> AsyncIterator[bytes]:
        text_offsets: dict[int, int] = {}
        with_ids = self.body.return_token_ids
        prompt_ids_sent: set[int] = set()
        async for index, output in group.outputs():
            first = index not in text_offsets
            text = output.text
            logprobs = None
            if self.body.logprobs is not None:
                ids = [e.token_id for e in output.logprobs or []]
                logprobs, text_offsets[index] = self._logprobs(output, ids, text_offsets.get(index, 0),
                                                               with_prompt=first and self.body.echo)
            else:
                text_offsets[index] = 0
            if first and self.body.echo:
                text = self.prompt_text(index) + text
            if not self.has_news(output, content=bool(text), logprobs=bool(logprobs and logprobs.tokens)):
                continue
            prompt_ids = None
            if with_ids and index not in prompt_ids_sent:  # in each choice's first chunk, as vLLM
                prompt_ids_sent.add(index)
                prompt_ids = output.prompt_token_ids
            yield self.chunk(
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=output.finish_reason if output.finished else None,
                    stop_reason=output.stop_reason if output.finished else None,
                    prompt_token_ids=prompt_ids,
                    token_ids=list(output.token_ids) if with_ids else None,
                )
            )
