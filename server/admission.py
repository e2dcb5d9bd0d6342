"""Back-pressure: a bounded queue in front of the engine.

An engine request is *queued* from the moment the server submits it until its first
output arrives (it has been scheduled and prefilled) or it ends. When admitting a new
HTTP request would take the queue past `max_queue_len`, the request gets 429 with
`Retry-After`; one whose choices alone exceed the limit could never run and gets 400.
`active` holds the HTTP requests being served, which a graceful shutdown waits for.

The count is the server's own, kept on the event loop: no read of engine state from
another thread on every request. Requests past their first output are bounded by the
engine's max_num_seqs: a preempted one goes back to the front of the engine's waiting
list, so no new request starts while one waits. At most max_queue_len + max_num_seqs
engine requests are ever in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphserve.server.errors import bad_request, queue_full

RETRY_AFTER_S = 1


@dataclass
class Admission:
    max_queue_len: int
    queued: int = 0  # engine requests submitted by this server that have not produced output yet
    active: set[Any] = field(default_factory=set)  # the GenerationGroups running now (drained on shutdown)

    def admit(self, count: int) -> None:
        """Raise 429 (or 400) unless `count` more engine requests fit in the queue."""
        if count > self.max_queue_len:
            raise bad_request(
                f"This request needs {count} generations (prompts x n); the server queues at most "
                f"{self.max_queue_len} at a time.",
                param="n",
            )
        if self.queued + count > self.max_queue_len:
            raise queue_full(self.max_queue_len, RETRY_AFTER_S)

    def enter(self) -> None:
        self.queued += 1

    def leave(self) -> None:
        self.queued = max(0, self.queued - 1)
