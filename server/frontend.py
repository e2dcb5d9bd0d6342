"""A front-end process: one uvicorn server with the FastAPI app on the shared listening
socket, talking to the engine core over its own ZeroMQ socket. It validates and
tokenizes requests, detokenizes and streams the core's tokens. The supervisor starts
N of them (server/supervisor.py); they die with it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection
from typing import Any

from graphserve.engine.config import EngineConfig
from graphserve.server.settings import ServerSettings

logger = logging.getLogger("graphserve.server")


def run_frontend(index: int, server: ServerSettings, engine_config: EngineConfig, core_address: str,
                 core_pid: int, listener: socket.socket, ready: Connection, parent_pid: int,
                 log_format: str) -> None:
    """The process's entry point: serve until SIGTERM (drain, then exit 0) or until the
    engine core goes away (exit 1)."""
    from graphserve.engine.child_process import die_with_parent, dump_stacks_on_sigusr1, freeze_startup_objects

    die_with_parent(parent_pid)
    os.setpgrp()  # Ctrl-C in a terminal reaches the supervisor alone, which forwards one SIGTERM
    dump_stacks_on_sigusr1()
    logging.basicConfig(level=getattr(logging, server.log_level.upper(), logging.INFO),
                        format=log_format.replace("%(name)s", f"%(name)s[api{index}]"), datefmt="%H:%M:%S")
    from graphserve.engine.async_engine import AsyncEngine
    from graphserve.server import connections
    from graphserve.server.app import create_app_from_settings
    from graphserve.server.draining import FLUSH_TIMEOUT_S, DrainingServer
    from graphserve.server.state import ServerState

    failures: list[BaseException] = []
    http_server: DrainingServer | None = None

    def on_ready(state: ServerState) -> None:
        freeze_startup_objects()  # the app, the tokenizer and the engine client live as long as we do
        ready.send(state.model_name)
        ready.close()

    def on_engine_failure(exc: BaseException) -> None:
        failures.append(exc)
        if http_server is not None:
            http_server.should_exit = True

    app = create_app_from_settings(AsyncEngine(engine_config, core_address=core_address, core_pid=core_pid), server,
                                   engine_config, on_ready=on_ready, on_engine_failure=on_engine_failure)
    # the drain already waited --shutdown-timeout before the flush
    config = connections.uvicorn_config(app, server, timeout_graceful_shutdown=FLUSH_TIMEOUT_S)
    http_server = DrainingServer(config, app.state.graphserve, drain_timeout=server.shutdown_timeout)
    signal.signal(signal.SIGTERM, _exit_cleanly)  # uvicorn replaces it while it runs, and re-raises after
    try:
        http_server.run(sockets=[listener])
    except KeyboardInterrupt:
        pass
    if failures:
        print(f"graphserve: the engine failed: {failures[0]!r}", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(0)


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)
