"""The prefix-cache block keys of a request's prompt, computed in the ingress for the request router: the
prompt token ids exactly as the replica will build them (the chat template and tools of
server/chat_prompt.py, the tokenizer of the model), hashed as the engine's prefix cache hashes them
(engine/sched/prefix_hash.py, with the block size and chain root the replicas report). Only the keys
leave here; the text is not kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from graphserve.engine.errors import GraphserveError
from graphserve.engine.sched.prefix_hash import prompt_keys
from graphserve.server.chat_prompt import chat_request_prompt
from graphserve.server.errors import APIError
from graphserve.server.protocol import ChatCompletionRequest, CompletionRequest
from graphserve.server.routes_completions import normalize_prompts
from graphserve.server.tools import call_format, check_tool_request

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class CacheLayout:
    """What the replicas' engines report about their prefix cache (the same for every replica of one
    model): the block size, and the hash chain's root (None: prefix caching is off, so no keys)."""

    block_size: int
    root: bytes | None


class RoutingKeys:
    def __init__(self, tokenizer: Any, layout: CacheLayout, chat_content_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.layout = layout
        self.chat_content_special_tokens = chat_content_special_tokens

    def of(self, path: str, body: bytes) -> tuple[bytes, ...]:
        """The keys of the request's (first) prompt; none for other routes, and for a body the replica
        will refuse (it answers with the 400 itself)."""
        if self.layout.root is None or path not in (CHAT_PATH, COMPLETIONS_PATH):
            return ()
        try:
            ids = self._chat_prompt(body) if path == CHAT_PATH else self._completion_prompt(body)
        except (ValidationError, APIError, GraphserveError, ValueError):
            return ()
        return tuple(prompt_keys(ids, self.layout.block_size, self.layout.root))

    def _chat_prompt(self, body: bytes) -> list[int]:
        request = ChatCompletionRequest.model_validate_json(body)
        fmt = call_format(self.tokenizer.chat_template)
        return chat_request_prompt(self.tokenizer, request, fmt, check_tool_request(request),
                                   self.chat_content_special_tokens)

    def _completion_prompt(self, body: bytes) -> list[int]:
        first = normalize_prompts(CompletionRequest.model_validate_json(body).prompt)[0]
        return self.tokenizer.encode(first) if isinstance(first, str) else list(first)
