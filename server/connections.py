"""Connections: timeouts, a connection limit, and log lines that cannot flood.

uvicorn alone holds a connection that never sends a complete request for ever (it has
a keep-alive timeout, but none for a request's head or body), and its only limit
(`limit_concurrency`) answers 503 to everyone, /health included, once a flood of
idle connections fills it. `uvicorn_config()` builds the server's uvicorn.Config with
an HTTP protocol (h11) that adds:

- a *header timeout*: from the connection's start, or from the first byte of a
  keep-alive connection's next request, until the request's head is complete;
- a *body timeout*: from the head until the whole body has arrived;
  either one answers `408` (when nothing was sent yet) and closes the connection; the
  route reading the body sees the client-disconnect case (a silent 499);
- a *connection limit*: past `max_connections` open connections, a new one evicts the
  oldest connection that has no request in progress (waiting for a request head, or
  idle between keep-alive requests), so a flood of half-open connections cannot lock
  out /health; when every connection is busy with a request, the new one is answered
  `503` and closed at once, so the file descriptors stay bounded;
- the soft RLIMIT_NOFILE raised to the hard limit (the limit is lowered, with a
  warning, when the descriptors allowed cannot hold it);
- a rate limit on the log lines of uvicorn, asyncio (`accept() out of system
  resource`) and this module, so a flood cannot turn into gigabytes of log.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from graphserve.server.settings import ServerSettings

logger = logging.getLogger("graphserve.connections")

KEEP_ALIVE_S = 5.0  # uvicorn's default: an idle keep-alive connection is closed after this
FD_MARGIN = 256  # descriptors kept for the engine, the model files, logs, the IPC sockets
BACKLOG = 2048  # uvicorn's default: connections the kernel queues, and asyncio accepts per wake-up
RATE_LIMITED_LOGGERS = ("uvicorn.error", "asyncio", "graphserve.connections")
LOG_BURST = 10  # records per key per interval let through
LOG_TOTAL = 100  # records per interval across all keys of one filter
LOG_INTERVAL_S = 10.0

_TIMEOUT_BODY = b'{"error":{"message":"%s","type":"invalid_request_error","param":null,"code":"request_timeout"}}'
_OVERLOAD_BODY = (
    b'{"error":{"message":"The server has too many open connections; retry shortly.",'
    b'"type":"service_unavailable_error","param":null,"code":"too_many_connections"}}'
)


def _raw_response(status: bytes, body: bytes, extra_headers: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n" + extra_headers
        + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _timeout_response(what: str) -> bytes:
    return _raw_response(b"408 Request Timeout", _TIMEOUT_BODY % what.encode())


OVERLOAD_RESPONSE = _raw_response(b"503 Service Unavailable", _OVERLOAD_BODY, b"retry-after: 1\r\n")


@dataclass
class ConnectionLimits:
    """The limits of one server, and its connections that have no request in progress
    (oldest first): the ones a new connection may evict."""

    max_connections: int
    header_timeout: float
    body_timeout: float
    open: int = 0
    idle: OrderedDict[Any, None] = field(default_factory=OrderedDict)
    evicted: int = 0
    refused: int = 0
    timed_out: int = 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the timeouts and the connection limit of the module doc.
    `limits` is set on the subclass that `protocol_class()` makes for each server.

    Phases: "head" (waiting for a request head; the header timer runs), "request" (the
    app has the request; the body timer runs until the body is complete), "idle"
    (between keep-alive requests; uvicorn's keep-alive timer runs). Only "head" and
    "idle" connections may be evicted."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = "head"
        self._timer: asyncio.TimerHandle | None = None
        self._current_cycle: Any = None
        self._counted = False

    # ---- the connection ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        limits.open += 1
        self._counted = True
        if limits.open > limits.max_connections and not self._evict_one():
            limits.refused += 1
            logger.warning(
                "refusing a connection: %d open, all busy with requests (--max-connections %d)",
                limits.open - 1, limits.max_connections,
            )
            transport.write(OVERLOAD_RESPONSE)
            transport.close()
            return
        self._enter_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.limits.idle.pop(self, None)
        if self._counted:
            self._counted = False
            self.limits.open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == "idle":  # the first bytes of the next request: its head is timed
            self._enter_head()
        super().data_received(data)
        self._follow_cycle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if not self._follow_cycle() and self._phase == "request" and self.cycle.response_complete:
            self._cancel_timer()
            self._phase = "idle"  # uvicorn's keep-alive timer now runs
            self._make_evictable()

    # ---- phases ------------------------------------------------------------------------

    def _enter_head(self) -> None:
        self._phase = "head"
        self._arm(self.limits.header_timeout, self._on_header_timeout)
        self._make_evictable()

    def _follow_cycle(self) -> bool:
        """After h11 parsed data: a new request head started a request; a complete body
        stops the body timer. True when a new request started."""
        cycle = self.cycle
        started = cycle is not None and cycle is not self._current_cycle
        if started:
            self._current_cycle = cycle
            self._phase = "request"
            self.limits.idle.pop(self, None)
            self._cancel_timer()
            if cycle.more_body:
                self._arm(self.limits.body_timeout, self._on_body_timeout)
        elif self._phase == "request" and cycle is not None and not cycle.more_body:
            self._cancel_timer()
        return started

    def _make_evictable(self) -> None:
        self.limits.idle[self] = None
        self.limits.idle.move_to_end(self)

    def _evict_one(self) -> bool:
        """Close the oldest connection that has no request in progress."""
        idle = self.limits.idle
        while idle:
            victim, _ = idle.popitem(last=False)
            if victim is self or victim.transport is None or victim.transport.is_closing():
                continue
            self.limits.evicted += 1
            logger.info("closing an idle connection from %s: %d open (--max-connections %d)",
                        _peer(victim), self.limits.open, self.limits.max_connections)
            victim._close(OVERLOAD_RESPONSE if victim._phase == "head" else None)
            return True
        return False

    # ---- timers ------------------------------------------------------------------------

    def _arm(self, delay: float, callback: Any) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_header_timeout(self) -> None:
        self._timer = None
        if self._phase != "head" or self.transport.is_closing():
            return
        self.limits.timed_out += 1
        logger.info("closing a connection from %s: no complete request head within %g s (--header-timeout)",
                    _peer(self), self.limits.header_timeout)
        self._close(_timeout_response(f"The request head did not arrive within {self.limits.header_timeout:g} s."))

    def _on_body_timeout(self) -> None:
        self._timer = None
        cycle = self.cycle
        if self._phase != "request" or cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        self.limits.timed_out += 1
        logger.info("closing a connection from %s: the request body did not arrive within %g s (--body-timeout)",
                    _peer(self), self.limits.body_timeout)
        response = None
        if not cycle.response_started:
            # the app, waiting for the body, then sees a disconnect; its answer goes nowhere
            response = _timeout_response(f"The request body did not arrive within {self.limits.body_timeout:g} s.")
        self._close(response)

    def _close(self, response: bytes | None) -> None:
        self._cancel_timer()
        self.limits.idle.pop(self, None)
        if response is not None:
            self.transport.write(response)
        self.transport.close()


def _peer(protocol: H11Protocol) -> str:
    client = protocol.client
    return f"{client[0]}:{client[1]}" if client else "?"


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol bound to one server's limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


# ---- file descriptors --------------------------------------------------------------------


def raise_fd_limit(needed: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit when it is below `needed`; return the
    soft limit now in force (a large number where the platform has no such limit)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 1 << 30
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    if soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, max(needed, soft))
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def fitted_max_connections(max_connections: int) -> int:
    """`max_connections`, lowered when the process may not open enough descriptors for it
    (each connection takes one; up to BACKLOG more are accepted before they are refused)."""
    needed = max_connections + BACKLOG + FD_MARGIN
    available = raise_fd_limit(needed)
    if available >= needed:
        return max_connections
    fitted = max(16, available - BACKLOG - FD_MARGIN)
    logger.warning("the open-file limit (%d) cannot hold --max-connections %d; using %d", available,
                   max_connections, fitted)
    return fitted


# ---- log rate limit ----------------------------------------------------------------------


class RateLimitFilter(logging.Filter):
    """Lets at most `burst` similar records (same logger, level and first line of the
    message) and `total` records in all through per `interval` seconds; the first record
    let through after some were dropped says how many."""

    def __init__(self, burst: int = LOG_BURST, total: int = LOG_TOTAL, interval: float = LOG_INTERVAL_S):
        super().__init__()
        self.burst, self.total, self.interval = burst, total, interval
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._counts: dict[tuple[str, int, str], int] = {}
        self._passed = 0
        self._dropped = 0
        self.dropped_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:120])
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self.interval:
                self._window_start, self._counts, self._passed = now, {}, 0
            count = self._counts.get(key, 0)
            if count >= self.burst or self._passed >= self.total:
                self._dropped += 1
                self.dropped_total += 1
                return False
            self._counts[key] = count + 1
            self._passed += 1
            dropped, self._dropped = self._dropped, 0
        if dropped:
            record.msg = f"{record.msg} [{dropped} similar log line(s) dropped by the rate limit]"
        return True


def install_log_rate_limits(loggers: tuple[str, ...] = RATE_LIMITED_LOGGERS) -> None:
    """One RateLimitFilter per logger (idempotent)."""
    for name in loggers:
        target = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in target.filters):
            target.addFilter(RateLimitFilter())


# ---- the uvicorn config ------------------------------------------------------------------


def uvicorn_config(app: Any, settings: ServerSettings, **overrides: Any) -> uvicorn.Config:
    """The uvicorn.Config of the server: address, log level and access log from
    `settings`, the guarded protocol, the limits; `overrides` are passed on as they are
    (e.g. timeout_graceful_shutdown)."""
    max_connections = fitted_max_connections(settings.max_connections)
    limits = ConnectionLimits(
        max_connections=max_connections,
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
    )
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "access_log": settings.log_requests,
        "http": protocol_class(limits),
        "timeout_keep_alive": KEEP_ALIVE_S,
        "backlog": BACKLOG,
    }
    options.update(overrides)
    config = uvicorn.Config(app, **options)  # configures uvicorn's loggers: the filters go on after
    install_log_rate_limits()
    return config
