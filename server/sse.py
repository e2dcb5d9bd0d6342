"""Response bodies on the wire: a JSON body encoded once, server-sent events, and an
event-stream response that always closes its source."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

DONE_EVENT = b"data: [DONE]\n\n"


def json_response(model: BaseModel, **dump_kwargs: Any) -> Response:
    """`model` as an application/json body, serialized by pydantic straight to JSON."""
    return Response(model.model_dump_json(**dump_kwargs), media_type="application/json")


def sse_event(payload: BaseModel | dict[str, Any], *, exclude: set[str] | None = None) -> bytes:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude=exclude)
    else:
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode("utf-8") + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """text/event-stream response whose event generator is closed however the response
    ends (finished, client disconnect, send error), so its engine requests are aborted
    at once rather than when the generator is garbage-collected. `on_close` runs after
    it: a generator that never started (the client left before the first event) has no
    `finally` to run, so the engine requests are released there."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        status_code: int = 200,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ):
        super().__init__(
            events,
            status_code=status_code,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self._on_close is not None:
                    await self._on_close()
