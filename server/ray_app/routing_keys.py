"""The prefix-cache block keys of a request's prompt, computed in the ingress for the request router: the
prompt token ids exactly as the replica will build them (the chat template and tools of
server/chat_prompt.py, the tokenizer of the model), hashed as the engine's prefix cache hashes them
(engine/sched/prefix_hash.py, with the block size and chain root the replicas report; a LoRA adapter's
prompts under a root of the adapter's name). Only the keys leave here; the text is not kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from graphserve.engine.errors import GraphserveError
from graphserve.engine.sched.prefix_hash import block_key, prompt_keys
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
    model): the block size, the hash chain's root (None: prefix caching is off, so no keys), and the names
    a request's `model` gives the base model by (any other name is a LoRA adapter's)."""

    block_size: int
    root: bytes | None
    base_models: frozenset[str] = frozenset()

    def root_for(self, model: str | None) -> bytes:
        """The chain root of a request's blocks: the engine's for the base model. An adapter's KV differs, and
        the engine roots its blocks at the id each replica gave the adapter when it loaded it, which replicas
        need not share: the router roots them at the adapter's name, apart from the base model's and from
        each other adapter's."""
        assert self.root is not None
        if not model or model in self.base_models:
            return self.root
        return block_key(self.root, b"lora-name:" + model.encode())


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
            if path == CHAT_PATH:
                request = ChatCompletionRequest.model_validate_json(body)
                ids = self._chat_prompt(request)
            else:
                request = CompletionRequest.model_validate_json(body)
                ids = self._completion_prompt(request)
        except (ValidationError, APIError, GraphserveError, ValueError):
            return ()
        return tuple(prompt_keys(ids, self.layout.block_size, self.layout.root_for(request.model)))

    def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        fmt = call_format(self.tokenizer.chat_template)
        return chat_request_prompt(self.tokenizer, request, fmt, check_tool_request(request),
                                   self.chat_content_special_tokens)

    def _completion_prompt(self, request: CompletionRequest) -> list[int]:
        first = normalize_prompts(request.prompt)[0]
        return self.tokenizer.encode(first) if isinstance(first, str) else list(first)
