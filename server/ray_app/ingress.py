"""GraphserveIngress: the HTTP entry of the Ray app, behind Ray Serve's proxy. For each request it reads
the body (bounded, as graphserve's routes do), computes its prompt's prefix-cache keys
(ray_app/routing_keys.py), and hands the request to a replica through a deployment handle, whose
request router (ray_app/router.py) picks the replica; then it relays the replica's response as it
streams. Routes, validation and errors are the replica's: every path is forwarded.

Faults: a response is held until its first body chunk. If a replica fails the request before that
(its actor died, or it answers 503 `engine_dead` / `model_not_ready` / `shutting_down`, as a body or as a
stream's first event) the request goes to another replica, up to MAX_ATTEMPTS in all; once a chunk
went to the client it is not retried: a stream whose replica dies after that ends with an error event
and [DONE]."""

# no `from __future__ import annotations` here: serve.ingress rebuilds the route's signature, and FastAPI
# must see `Request` as a class, not a string, to pass the request in
import asyncio
import json
import logging
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Receive, Scope, Send

from graphserve.server.errors import APIError, install_error_handlers
from graphserve.server.generation import ClientDisconnected
from graphserve.server.ray_app.forwarded import ForwardedRequest, ResponseHead
from graphserve.server.ray_app.routing_keys import CacheLayout, RoutingKeys
from graphserve.server.request_body import read_body
from graphserve.server.sse import DONE_EVENT, sse_event

logger = logging.getLogger("graphserve.server")

MAX_ATTEMPTS = 3
RETRYABLE_CODES = frozenset({"engine_dead", "model_not_ready", "shutting_down"})
REPLICA_HEADER = b"x-graphserve-replica"  # which replica answered (logs, tests)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]

# serve.ingress pickles this app when the class below is defined: everything its route calls is defined above it
ingress_app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
install_error_handlers(ingress_app)  # a failure here is an OpenAI error body too, never a traceback


def replica_lost() -> APIError:
    return APIError(503, "The replica serving this request stopped; retry the request.", code="replica_unavailable")


async def relay(replicas: DeploymentHandle, request: ForwardedRequest) -> Response:
    """The response of the first replica that does not fail the request before its first body chunk."""
    exclude: set[str] = set()
    for attempt in range(MAX_ATTEMPTS):
        last = attempt == MAX_ATTEMPTS - 1
        stream = replicas.options(stream=True).handle_http.remote(replace(request, exclude=frozenset(exclude)))
        try:
            head = await stream.__anext__()
            first = await _next_chunk(stream)
        except RayActorError:  # the replica died before answering; Ray's router drops it
            logger.warning("a replica died before answering %s %s (attempt %d)", request.method, request.path,
                           attempt + 1)
            if last:
                return replica_lost().response()
            continue
        assert isinstance(head, ResponseHead)
        if not last and _refused(head, first):
            stream.cancel()
            exclude.add(head.replica)
            logger.warning("replica %s refused %s %s (%d); trying another", head.replica, request.method,
                           request.path, head.status)
            continue
        return RelayedResponse(head, first, stream)
    raise AssertionError("unreachable")


async def _next_chunk(stream: DeploymentResponseGenerator) -> bytes | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _refused(head: ResponseHead, first: bytes | None) -> bool:
    """Whether the replica failed the request before doing any of it: a 503 whose error code says the
    engine is dead, loading or draining, or a stream whose first event is that error."""
    if first is None or head.status not in (200, 503):
        return False
    # a stream's first chunk may hold several events (ray_app/asgi_call.py joins what waited): the first one
    text = first.split(b"\n\n", 1)[0].removeprefix(b"data: ") if head.status == 200 else first
    if not text.startswith(b'{"error"'):
        return False
    try:
        code = json.loads(text)["error"].get("code")
    except (ValueError, KeyError, AttributeError):
        return False
    return code in RETRYABLE_CODES


class RelayedResponse(Response):
    """A replica's response, as it streams: its head and first chunk (already here), then the rest. If the
    replica dies mid-stream an event stream ends with an error event and [DONE]; anything else is cut.
    The replica's stream is cancelled when the client leaves."""

    def __init__(self, head: ResponseHead, first: bytes | None, rest: DeploymentResponseGenerator):
        super().__init__(status_code=head.status)
        self.head = head
        self.first = first
        self.rest = rest
        self.raw_headers = [*head.headers, (REPLICA_HEADER, head.replica.encode())]
        self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in head.headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if self.first is not None:
                await send({"type": "http.response.body", "body": self.first, "more_body": True})
                async for chunk in self._rest():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            finished = True
        finally:
            if not finished:
                self.rest.cancel()

    async def _rest(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.rest:
                yield chunk
        except RayActorError:
            logger.warning("replica %s died while streaming a response", self.head.replica)
            if self.event_stream:
                yield sse_event(replica_lost().body())
                yield DONE_EVENT


@serve.ingress(ingress_app)
class GraphserveIngress:
    def __init__(self, replicas: DeploymentHandle, max_body_bytes: int, chat_content_special_tokens: bool = False):
        self.replicas = replicas
        self.max_body_bytes = max_body_bytes
        self.chat_content_special_tokens = chat_content_special_tokens
        self.routing_keys: RoutingKeys | None = None  # from the first replica that answers routing_info
        self.routing_keys_lock = asyncio.Lock()
        self.tokenizer_dir = tempfile.TemporaryDirectory(prefix="graphserve-ingress-")

    @ingress_app.api_route("/{path:path}", methods=METHODS)
    async def forward(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.max_body_bytes)
        except APIError as exc:
            return exc.response()
        except ClientDisconnected:
            return Response(status_code=499)
        keys = await self._prefix_keys(request.url.path, body) if request.method == "POST" else ()
        forwarded = ForwardedRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                                     list(request.headers.raw), body, keys)
        return await relay(self.replicas, forwarded)

    async def _prefix_keys(self, path: str, body: bytes) -> tuple[bytes, ...]:
        routing_keys = self.routing_keys or await self._load_routing_keys()
        if routing_keys is None:
            return ()
        return await asyncio.to_thread(routing_keys.of, path, body)

    async def _load_routing_keys(self) -> RoutingKeys | None:
        """The replicas' tokenizer and cache layout, asked once (None until a replica is ready to tell)."""
        async with self.routing_keys_lock:
            if self.routing_keys is None:
                try:
                    info = await self.replicas.routing_info.remote()
                except Exception:
                    logger.warning("no replica told its routing info yet: routing by load only", exc_info=True)
                    return None
                from graphserve.engine.tokenizer import Tokenizer

                folder = Path(self.tokenizer_dir.name)
                for name, data in info.tokenizer_files.items():
                    (folder / name).write_bytes(data)
                tokenizer = await asyncio.to_thread(Tokenizer, folder)
                layout = CacheLayout(info.block_size, info.prefix_cache_root, info.base_models)
                self.routing_keys = RoutingKeys(tokenizer, layout, self.chat_content_special_tokens)
            return self.routing_keys


def ingress_options() -> dict[str, Any]:
    """The ingress deployment's defaults: light (no CPU reserved), many requests in flight."""
    return {"name": "GraphserveIngress", "max_ongoing_requests": 4096, "ray_actor_options": {"num_cpus": 0}}
