"""The SSE client of every benchmark that streams: one POST, its events as they arrive, and what went wrong."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx


class EventStream:
    """One streamed request. `async for now, payload in stream.events()` yields the JSON of each
    `data:` event with the time.perf_counter() at which its bytes arrived ([DONE] left out).
    Nothing is raised: afterwards `error` says what went wrong, if anything (an HTTP status other
    than 200, an error event, or the exception that ended the stream: a reset, a timeout), so a
    benchmark counts the failure and goes on."""

    def __init__(self, http: httpx.AsyncClient, path: str, body: dict[str, Any]):
        self.http = http
        self.path = path
        self.body = body
        self.error: str | None = None

    async def events(self) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        buffer = b""
        try:
            async with self.http.stream("POST", self.path, json=self.body) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return
                async for chunk in response.aiter_raw():
                    now = time.perf_counter()
                    buffer += chunk
                    *complete, buffer = buffer.split(b"\n\n")
                    for event in complete:
                        if not event.startswith(b"data: ") or event[6:] == b"[DONE]":
                            continue
                        payload = json.loads(event[6:])
                        if "error" in payload:  # the server ends the stream after it
                            self.error = f"SSE error: {str(payload['error'])[:200]}"
                            continue
                        yield now, payload
        except Exception as e:  # connection reset, timeout, ...: counted, not fatal
            self.error = f"{type(e).__name__}: {e}"[:300]
