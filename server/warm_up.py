"""A front end's warm-up before it reports ready: a few requests through its own ASGI app, in
process, after the engine core has run its warm-up burst (CUDA). What a front end does for the
first time costs it tens of milliseconds (imports done on first use, pydantic's and the JSON
encoder's first objects of a kind, the detokenizer's and the SSE path's first stream); a first
burst of clients would otherwise pay it in their time to first token. Its requests are ordinary
ones to the engine (a few tokens each); the front end's metrics start from zero after it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from graphserve.server.metrics import ServerMetrics
from graphserve.server.state import ServerState

logger = logging.getLogger("graphserve.server")

MESSAGES = [{"role": "user", "content": "Hi"}]
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True, "logprobs": 1,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True, "logprobs": True,
                              "top_logprobs": 1, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "response_format": {"type": "json_object"}}),
]


async def warm_up_front_end(app: Any, state: ServerState) -> float:
    """Send REQUESTS through `app`; returns the seconds taken. A request that fails is logged, never
    raised: the warm-up saves time, it is not a check."""
    started = time.perf_counter()
    headers = [(b"content-type", b"application/json")]
    if state.api_key:
        headers.append((b"authorization", f"Bearer {state.api_key}".encode()))
    took = []
    for path, body in REQUESTS:
        sent = time.perf_counter()
        try:
            status = await _post(app, path, json.dumps({"model": state.model_name, **body}).encode(), headers)
        except Exception:  # noqa: BLE001
            logger.warning("front-end warm-up: %s failed", path, exc_info=True)
            continue
        finally:
            took.append(f"{time.perf_counter() - sent:.2f}")
        if status != 200:
            logger.warning("front-end warm-up: %s answered %d", path, status)
    state.metrics = ServerMetrics(state.engine)
    seconds = time.perf_counter() - started
    logger.info("front end warmed up in %.2fs (its requests: %s s)", seconds, ", ".join(took))
    return seconds


async def _post(app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """One POST through the ASGI app, its response read to the end; returns the status."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [*headers, (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }
    body_sent = False
    finished = asyncio.Event()
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()  # the client stays connected until the response is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            finished.set()

    await app(scope, receive, send)
    finished.set()
    return status
