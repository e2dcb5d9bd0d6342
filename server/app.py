"""create_app(engine): the FastAPI application around one AsyncEngine.

The engine loads in a background task of the app's lifespan, so uvicorn accepts
connections at once and /health answers 503 until the model is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from graphserve.engine.config import EngineConfig
from graphserve.engine.errors import EngineDeadError
from graphserve.server import (
    routes_chat,
    routes_completions,
    routes_debug,
    routes_health,
    routes_lora,
    routes_models,
    routes_responses,
    routes_tokenize,
)
from graphserve.server.admission import Admission
from graphserve.server.errors import install_error_handlers
from graphserve.server.generation import ClientDisconnected
from graphserve.server.lora_registry import LoraRegistry
from graphserve.server.metrics import ServerMetrics
from graphserve.server.reasoning import parser_name
from graphserve.server.settings import ServerSettings, fault_injection_enabled, lora_registry
from graphserve.server.state import ServerState
from graphserve.server.warm_up import warm_up_front_end

logger = logging.getLogger("graphserve.server")


ENGINE_WATCH_INTERVAL_S = 0.5


def create_app(
    engine: Any,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    log_requests: bool = False,
    chat_content_special_tokens: bool = False,
    reasoning_parser: str | None = None,
    max_queue_len: int = ServerSettings.max_queue_len,
    max_body_bytes: int = ServerSettings.max_body_bytes,
    allowed_origins: list[str] | None = None,
    enable_fault_injection: bool = False,
    loras: LoraRegistry | None = None,
    on_ready: Callable[[ServerState], None] | None = None,
    on_engine_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """Build the app. `engine` is an engine.AsyncEngine, not yet started: the lifespan
    starts it and shuts it down. `on_ready` lets the CLI print the URL;
    `on_engine_failure` is called once if the engine fails to start or dies later
    (the CLI then stops the process with a non-zero status, so a supervisor restarts it).
    Requests beyond `max_queue_len` waiting engine requests get 429, bodies over
    `max_body_bytes` 413; CORS headers are sent only for `allowed_origins`;
    `enable_fault_injection` (tests only) adds POST /debug/fault. `loras`: the LoRA adapters served by
    name (the engine runs with enable_lora); with runtime updates on, POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter change them."""
    state = ServerState(
        engine=engine,
        metrics=ServerMetrics(engine),
        admission=Admission(max_queue_len=max_queue_len),
        served_model_name=served_model_name,
        api_key=api_key or None,
        log_requests=log_requests,
        chat_content_special_tokens=chat_content_special_tokens,
        reasoning_setting=parser_name(reasoning_parser),
        max_body_bytes=max_body_bytes,
        loras=loras,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # anyio imports its asyncio backend on first use (~40-50 ms), which would otherwise
        # land on this front end's first streamed response
        await anyio.sleep(0)
        supervisor = asyncio.create_task(_run_engine(app, state, on_ready, on_engine_failure))
        try:
            yield
        finally:
            state.draining = True
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
            try:
                await engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    app = FastAPI(title="graphserve", version="0.1.0", lifespan=lifespan, redirect_slashes=False)
    app.state.graphserve = state
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _client_disconnected)  # type: ignore[arg-type]
    for module in (routes_completions, routes_chat, routes_responses, routes_models, routes_tokenize, routes_health):
        app.include_router(module.router)
    if loras is not None and loras.runtime_updates:
        app.include_router(routes_lora.router)
    if enable_fault_injection:
        logger.warning("fault injection is enabled (POST /debug/fault): for tests only")
        app.include_router(routes_debug.router)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["Retry-After"],
        )
    return app


def create_app_from_settings(engine: Any, server: ServerSettings, engine_config: EngineConfig, *,
                             on_ready: Callable[[ServerState], None] | None = None,
                             on_engine_failure: Callable[[BaseException], None] | None = None) -> FastAPI:
    """create_app with `graphserve serve`'s settings: a front-end process (server/frontend.py) and a Ray
    Serve replica (server/ray_app/replica.py) build the same app from them."""
    return create_app(
        engine,
        served_model_name=server.served_model_name,
        api_key=server.api_key,
        log_requests=server.log_requests,
        chat_content_special_tokens=server.chat_content_special_tokens,
        reasoning_parser=server.reasoning_parser,
        max_queue_len=server.max_queue_len,
        max_body_bytes=server.max_body_bytes,
        allowed_origins=server.allowed_origins,
        enable_fault_injection=fault_injection_enabled(),
        loras=lora_registry(server, engine_config),
        on_ready=on_ready,
        on_engine_failure=on_engine_failure,
    )


async def _run_engine(
    app: FastAPI,
    state: ServerState,
    on_ready: Callable[[ServerState], None] | None,
    on_engine_failure: Callable[[BaseException], None] | None,
) -> None:
    """Start the engine, warm this front end up where the engine core warmed up (server/warm_up.py),
    then watch the engine: a dead engine loop must not go unnoticed."""
    try:
        await state.engine.start()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        state.startup_error = exc
        if isinstance(exc, EngineDeadError):  # the core died starting: it logged why, and the supervisor says it
            logger.error("the engine failed to start: %s", exc)
        else:
            logger.error("the engine failed to start", exc_info=exc)
        if on_engine_failure is not None:
            on_engine_failure(exc)
        return
    if state.loras is not None:  # runtime loads are checked against the served model
        await asyncio.to_thread(state.loras.bind, state.engine.model_path)
    logger.info(
        "engine ready: model %s (%s), max_model_len %d",
        state.model_name,
        state.engine.model_path,
        state.engine.max_model_len,
    )
    logger.info(state.reasoning_choice()[1])
    if getattr(getattr(state.engine, "info", None), "warmed_up", False):
        await warm_up_front_end(app, state)
    state.warming_up = False
    if on_ready is not None:
        on_ready(state)
    while not state.engine.dead:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    error = getattr(state.engine, "error", None) or RuntimeError("the engine loop stopped")
    logger.error("the engine died: %r; /health now answers 503", error)
    if on_engine_failure is not None:
        on_engine_failure(error)


async def _client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=499)  # nobody reads it; the engine requests are already aborted
