"""Run one HTTP request through an ASGI app in this process, as an async iterator: the response's head
(status, headers), then its body chunks as the app sends them. The replica serves the graphserve app
this way (no socket of its own: Ray Serve's proxy has the client). Closing the iterator early is the
client's disconnect: the app is told, and aborts the request's engine work."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

logger = logging.getLogger("graphserve.server")

_END = object()  # the app returned
APP_EXIT_GRACE_S = 5.0  # after a disconnect, the app gets this long to wind down before it is cancelled


async def call_asgi(app: Any, scope: dict[str, Any], body: bytes) -> AsyncIterator[tuple[int, list] | bytes]:
    """Yields (status, headers) once, then the body as it comes: the chunks the app sent since the last
    item, joined (one item per chunk at low load; under load one per pass, not one per event). An app that
    ends without a response (it never does: graphserve's error handlers answer everything) yields a 500."""
    pending: deque = deque()  # what the app sent, not yet yielded
    arrived = asyncio.Event()
    disconnected = asyncio.Event()
    body_delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal body_delivered
        if not body_delivered:
            body_delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if disconnected.is_set():
            raise OSError("the client disconnected")
        pending.append(message)
        arrived.set()

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except Exception:
            logger.exception("the app failed on %s %s", scope.get("method"), scope.get("path"))
        finally:
            pending.append(_END)
            arrived.set()

    task = asyncio.create_task(run())
    started = False
    try:
        while True:
            if not pending:
                arrived.clear()
                await arrived.wait()
                continue
            message = pending.popleft()
            if message is _END:
                if not started:
                    yield 500, [(b"content-type", b"text/plain")]
                return
            if message["type"] == "http.response.start":
                started = True
                yield message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                chunks, more = [bytes(message.get("body", b""))], message.get("more_body", False)
                while more and pending and pending[0] is not _END and pending[0]["type"] == "http.response.body":
                    message = pending.popleft()
                    chunks.append(bytes(message.get("body", b"")))
                    more = message.get("more_body", False)
                if chunk := b"".join(chunks):
                    yield chunk
                if not more:
                    return
    finally:
        disconnected.set()  # a no-op for an app that has finished
        if not task.done():
            asyncio.get_running_loop().call_later(APP_EXIT_GRACE_S, task.cancel)
