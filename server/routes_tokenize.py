"""POST /tokenize and POST /detokenize (vLLM-compatible helpers)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from graphserve.server import openapi
from graphserve.server.auth import require_api_key
from graphserve.server.chat_prompt import render_chat_prompt
from graphserve.server.errors import bad_request
from graphserve.server.protocol import DetokenizeRequest, TokenizeRequest
from graphserve.server.response_bodies import DetokenizeResponse, TokenizeResponse
from graphserve.server.request_body import parse_body
from graphserve.server.request_params import check_token_id
from graphserve.server.sse import json_response
from graphserve.server.state import get_state

router = APIRouter(dependencies=[Depends(require_api_key)])


_ERRORS = (400, 401, 404, 413, 503)


@router.post(
    "/tokenize",
    openapi_extra=openapi.request_body(TokenizeRequest, example={"prompt": "Hello"}),
    responses=openapi.responses(TokenizeResponse, errors=_ERRORS),
)
async def tokenize(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, TokenizeRequest)
    engine = state.ready_engine(body.model)
    tokenizer = engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Give exactly one of `prompt` or `messages`.", param="prompt")
    # O(body size): off the event loop
    result = await asyncio.to_thread(_tokenize, tokenizer, body, engine.max_model_len,
                                     state.chat_content_special_tokens)
    return json_response(result, exclude_none=True)


def _tokenize(tokenizer: Any, body: TokenizeRequest, max_model_len: int,
              parse_special_in_content: bool) -> TokenizeResponse:
    if body.messages is not None:
        tokens = render_chat_prompt(tokenizer, body.messages, body.add_generation_prompt, parse_special_in_content)
    else:
        assert body.prompt is not None
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    result = TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens)
    if body.return_token_strs:
        result.token_strs = [tokenizer.token_text(t) for t in tokens]
    return result


@router.post(
    "/detokenize",
    openapi_extra=openapi.request_body(DetokenizeRequest, example={"tokens": [1, 2, 3]}),
    responses=openapi.responses(DetokenizeResponse, errors=_ERRORS),
)
async def detokenize(request: Request) -> Response:
    state = get_state(request)
    body = await parse_body(request, DetokenizeRequest)
    engine = state.ready_engine(body.model)
    tokenizer = engine.tokenizer
    for token_id in body.tokens:
        check_token_id(token_id, tokenizer.vocab_size, "tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
    return json_response(DetokenizeResponse(prompt=text))
