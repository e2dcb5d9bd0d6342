"""What the routes share: the engine, the served model name, metrics; and the
checks every generation route makes first (ready, model name)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request

from graphserve.engine.request import LoraRequest
from graphserve.server.admission import Admission
from graphserve.server.errors import engine_dead, model_not_found, not_ready, shutting_down
from graphserve.server.lora_registry import LoraRegistry
from graphserve.server.metrics import ServerMetrics
from graphserve.server.reasoning import resolve_parser

Status = Literal["failed", "dead", "draining", "loading", "ok"]


@dataclass
class ServerState:
    engine: Any  # engine.AsyncEngine (typed loosely so tests can pass a stand-in)
    metrics: ServerMetrics
    admission: Admission
    max_body_bytes: int
    served_model_name: str | None = None
    api_key: str | None = None
    log_requests: bool = False
    chat_content_special_tokens: bool = False  # see render_chat_prompt
    reasoning_setting: str = "auto"  # --reasoning-parser: a parser, auto or none (server/reasoning.py)
    created: int = field(default_factory=lambda: int(time.time()))
    startup_error: BaseException | None = None
    draining: bool = False  # shutting down: finish running requests, take no new ones
    warming_up: bool = True  # until the front end's own warm-up is done (server/warm_up.py): /health says loading
    loras: LoraRegistry | None = None  # the LoRA adapters served by name (None: LoRA off)

    _reasoning: tuple[str | None, str] | None = field(default=None, init=False, repr=False)  # resolve_parser's

    @property
    def reasoning_parser(self) -> str | None:
        """The reasoning parser in use: the setting, or (auto) the one the model's chat template implies."""
        return self.reasoning_choice()[0]

    def reasoning_choice(self) -> tuple[str | None, str]:
        """(the parser, a log line saying why); needs the loaded engine's tokenizer."""
        if self._reasoning is None:
            template = getattr(getattr(self.engine, "tokenizer", None), "chat_template", None)
            self._reasoning = resolve_parser(self.reasoning_setting, template)
        return self._reasoning

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model_name

    def status(self) -> Status:
        """failed (never started) > dead (the loop stopped) > draining > loading > ok."""
        if self.startup_error is not None:
            return "failed"
        if self.engine.dead:
            return "dead"
        if self.draining:
            return "draining"
        if not self.engine.ready:
            return "loading"
        return "ok"

    def health(self) -> Status:
        """What /health reports: status(), but loading until this front end has warmed up. The
        warm-up's own requests (and any client's that comes before /health says ok) are served."""
        status = self.status()
        return "loading" if status == "ok" and self.warming_up else status

    def ready_engine(self, model: str | None = None) -> Any:
        """The engine, or a 503 unless it is ok; then a 404 unless `model` names it (see check_model)."""
        status = self.status()
        if status in ("failed", "dead"):
            raise engine_dead()
        if status == "draining":
            raise shutting_down()
        if status == "loading":
            raise not_ready()
        self.check_model(model)
        return self.engine

    def check_model(self, requested: str | None) -> None:
        """Accept the served name, the engine's own name, the local path or a LoRA adapter's name; else 404."""
        if requested is None or requested == "":
            return
        if requested in (self.model_name, self.engine.model_name, self.engine.model_path):
            return
        if self.adapter(requested) is not None:
            return
        raise model_not_found(requested)

    def adapter(self, requested: str | None) -> LoraRequest | None:
        """The LoRA adapter `requested` names, or None (the base model)."""
        if self.loras is None or requested in (self.model_name, self.engine.model_name, self.engine.model_path):
            return None
        return self.loras.get(requested)

    def response_model(self, requested: str | None) -> str:
        """The `model` a response carries: the adapter's name when one was asked for, else the served name."""
        lora = self.adapter(requested)
        return lora.name if lora is not None else self.model_name


def get_state(request: Request) -> ServerState:
    return request.app.state.graphserve


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
