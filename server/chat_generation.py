"""A chat request -> what the engine runs: the parameters (sampling, the response_format or tool
grammar, the reasoning parser's part in both), the prompt through the chat template, and how each
choice's output is read back. /v1/chat/completions and /v1/responses (which is translated into a
chat request) both start here."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from graphserve.engine.request import SamplingParams
from graphserve.server.chat_prompt import chat_request_prompt
from graphserve.server.errors import bad_request
from graphserve.server.protocol import ChatCompletionRequest
from graphserve.server.reasoning import ReasoningConfig, reasoning_config
from graphserve.server.request_params import build_sampling_params
from graphserve.server.state import ServerState
from graphserve.server.structured_request import grammar_from_request
from graphserve.server.tools import HARMONY, CallFormat, call_format, check_tool_request, tool_grammar


@dataclass
class PreparedChat:
    """The engine's input for one chat request, and how its choices' outputs are parsed."""

    prompt_ids: list[int]
    params: SamplingParams  # the first choice's (request_params.for_choice derives the others)
    tools: CallFormat | None  # the call format to parse, when the request may call tools
    reasoning: ReasoningConfig | None  # --reasoning-parser: each choice's thinking split from its answer


async def prepare_chat(state: ServerState, engine: Any, body: ChatCompletionRequest) -> PreparedChat:
    """Validate and render `body`: 400 for bad parameters, 429 when its n choices do not fit the
    queue; the cheap checks come before the template and the tokenizer (O(body size), run off the
    event loop), and a grammar is compiled last (a 400 when it fails or takes too long)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    tokenizer = engine.tokenizer
    fmt = call_format(tokenizer.chat_template)
    use_tools = check_tool_request(body)
    grammar = grammar_from_request(body)
    if use_tools:
        if fmt is HARMONY and state.reasoning_parser != "gpt-oss":
            raise bad_request("this model writes tool calls in harmony's format, which the gpt-oss reasoning parser "
                              "reads: serve it with --reasoning-parser gpt-oss (or auto)", param="tools")
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
    prompt_ids = await asyncio.to_thread(chat_request_prompt, tokenizer, body, fmt, use_tools,
                                         state.chat_content_special_tokens)
    if not prompt_ids:
        raise bad_request("messages render to an empty prompt", param="messages")
    reasoning = reasoning_config(state.reasoning_parser, tokenizer, prompt_ids)
    if reasoning is not None:
        params = reasoning.adjust(params)  # the grammar leaves the thinking free; markers kept where needed
    if params.grammar is not None:  # a 400 for a grammar that fails or takes too long to compile
        await engine.check_grammar(params.grammar)
    return PreparedChat(prompt_ids, params, fmt if use_tools else None, reasoning)
