"""Graceful shutdown: on SIGTERM/SIGINT keep listening while running requests finish.

uvicorn alone would close the listening socket at once, so a load balancer would see
refused connections rather than a 503. `DrainingServer` first *drains*: /health and
new requests answer 503 (`state.draining`), the requests already running get
`drain_timeout` seconds to end, and whatever still runs then is ended with a clean
error (an SSE error event then [DONE], or a 503 body). Only then does uvicorn shut down.
A second signal skips the wait. When the engine died (the app then asks uvicorn to
stop), the server keeps answering 503 for a second before it closes, so health checks
see it; the process then exits non-zero (cli.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

import uvicorn

from graphserve.server.errors import shutting_down
from graphserve.server.state import ServerState

logger = logging.getLogger("graphserve.server")

DRAIN_POLL_S = 0.05
FLUSH_TIMEOUT_S = 5.0  # after the drain: time to send the last events before connections are cut
DEAD_ENGINE_LINGER_S = 1.0  # a dead engine: keep answering 503 this long before the listener closes


async def drain(state: ServerState, timeout: float, give_up: Callable[[], bool] = lambda: False) -> int:
    """Refuse new work, wait up to `timeout` s for the running requests, end the rest.
    Returns how many requests had to be ended."""
    state.draining = True
    if state.engine.dead:  # nothing can finish; let health checks and clients see the 503s first
        await asyncio.sleep(DEAD_ENGINE_LINGER_S)
    active = state.admission.active
    if active:
        logger.info("draining: %d request(s) running; waiting up to %.0f s", len(active), timeout)
    deadline = time.monotonic() + timeout
    while active and time.monotonic() < deadline and not give_up() and not state.engine.dead:
        await asyncio.sleep(DRAIN_POLL_S)
    unfinished = list(active)
    for group in unfinished:
        group.interrupt(shutting_down())
    if unfinished:
        logger.warning("drain timeout: ended %d running request(s)", len(unfinished))
    return len(unfinished)


class DrainingServer(uvicorn.Server):
    """uvicorn that drains (see the module doc) before it stops listening."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.graphserve_state = state
        self.drain_timeout = drain_timeout

    async def main_loop(self) -> None:
        await super().main_loop()  # returns once a signal (or an engine failure) asks to stop
        await drain(self.graphserve_state, self.drain_timeout, give_up=lambda: self.force_exit)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.graphserve_state.draining = True
        await super().shutdown(sockets)
