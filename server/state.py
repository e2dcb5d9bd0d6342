"""What the routes share: the engine, the served model name, metrics; and the
checks every generation route makes first (ready, model name)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from server.admission import Admission
from server.errors import engine_dead, model_not_found, not_ready, shutting_down
from server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: Any  # engine.AsyncEngine (typed loosely so tests can pass a stand-in)
    metrics: ServerMetrics
    admission: Admission
    served_model_name: str | None = None
    api_key: str | None = None
    log_requests: bool = False
    max_body_bytes: int = 1024**2
    created: int = field(default_factory=lambda: int(time.time()))
    startup_error: BaseException | None = None
    draining: bool = False  # shutting down: finish running requests, take no new ones

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model_name

    def ready_engine(self) -> Any:
        """The engine, or a 503 while it loads / after it died."""
        if self.engine.dead or self.startup_error is not None:
            raise engine_dead()
        if self.draining:
            raise shutting_down()
        if not self.engine.ready:
            raise not_ready()
        return self.engine

    def check_model(self, requested: str | None) -> None:
        """Accept the served name, the engine's own name, or the local path; else 404."""
        if requested is None or requested == "":
            return
        if requested in (self.model_name, self.engine.model_name, self.engine.model_path):
            return
        raise model_not_found(requested)


def get_state(request: Request) -> ServerState:
    return request.app.state.graphserve


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
