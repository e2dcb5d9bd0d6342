"""`graphserve serve`: the supervisor of the server's processes.

    supervisor ─┬─ engine core (engine/core/process.py): scheduler, KV cache, model, graphs
                └─ front end × N (server/frontend.py): HTTP, tokenize, detokenize, SSE

It binds one listening socket per front end on the one port (SO_REUSEPORT: the kernel
spreads new connections evenly over them, bursts included, where a shared socket lets
whichever front end wakes first accept the whole queue), prints the ready line once all
front ends are ready, and keeps the processes' fates tied together:
- SIGTERM / SIGINT: each front end drains (its running requests finish), then the core
  is stopped; exit 0.
- the core dies: the front ends end their open requests with an error and exit 1;
  so does the supervisor. If the core died starting, the supervisor's last line names why.
- a front end dies: everything is stopped; exit 1.
- the supervisor dies: the kernel kills the children (engine/child_process.py, die_with_parent).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from graphserve.engine.config import EngineConfig
from graphserve.server.settings import ServerSettings

logger = logging.getLogger("graphserve.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CHILD_EXIT_GRACE_S = 10.0  # after the core died: time the front ends get to fail their streams and exit


def frontend_count(server: ServerSettings, engine: EngineConfig) -> int:
    """--api-server-count, else 1 on CPU and, on a GPU machine, a front end per ~3 spare cores
    (the core's loop takes one), at most 4."""
    if server.api_server_count is not None:
        return server.api_server_count
    if server.allow_runtime_lora_updating:  # one front end keeps the adapter names
        return 1
    on_gpu = engine.device.startswith("cuda") or (engine.device == "auto" and Path("/proc/driver/nvidia").exists())
    if not on_gpu:
        return 1
    return max(1, min(4, ((os.cpu_count() or 1) - 2) // 3))


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on host:port (SO_REUSEPORT when there are several)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listeners = []
    for _ in range(count):
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if count > 1:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind((host, port))
        listener.listen(2048)
        listeners.append(listener)
    return listeners


def serve(server: ServerSettings, engine: EngineConfig) -> int:
    count = frontend_count(server, engine)
    listeners = bind_listeners(server.host, server.port, count)
    if count == 1:
        return _serve(server, engine, listeners)
    # /metrics of any front end adds up all of them (server/metrics.py), from their files in this folder
    metrics_dir = tempfile.mkdtemp(prefix="graphserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        return _serve(server, engine, listeners)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _serve(server: ServerSettings, engine: EngineConfig, listeners: list[socket.socket]) -> int:
    from graphserve.engine.core.process import remove_core_address, start_core_process

    count = len(listeners)
    url = f"http://{server.host}:{server.port}"
    core, address, core_failure = start_core_process(engine)
    spawn = multiprocessing.get_context("spawn")
    from graphserve.server.frontend import run_frontend

    frontends, waiting_ready = [], []
    for index in range(count):
        receiver, sender = spawn.Pipe(duplex=False)
        process = spawn.Process(target=run_frontend, name=f"graphserve-api{index}", args=(
            index, server, engine, address, core.pid, listeners[index], sender, os.getpid(), LOG_FORMAT))
        process.start()
        sender.close()
        listeners[index].close()  # the child has its own copy: once the front ends are gone, nothing listens
        frontends.append(process)
        waiting_ready.append(receiver)
    logger.info("engine core pid %d, %d front end(s) %s; loading the model; %s/health answers 503 until ready",
                core.pid, count, [p.pid for p in frontends], url)

    stopping: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        if not stopping:
            logger.info("signal %d: draining the front ends", signum)
            for process in frontends:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGTERM)
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = _watch(core, frontends, waiting_ready, stopping, url)
    for process in frontends:
        stop_process(process, signal.SIGTERM)
    stop_process(core, signal.SIGTERM)
    remove_core_address(address)
    cause = start_failure_cause(core_failure) if core.exitcode not in (0, -signal.SIGTERM) else None
    if cause is not None:
        # last, after every child's own lines: a bad --model reads as its cause, not as the front ends' echo
        print(f"graphserve: the engine could not start: {cause}", file=sys.stderr, flush=True)
        return 1
    return code


def start_failure_cause(pipe: Any) -> str | None:
    """What the core sent when it failed to start; None when it sent nothing (a core that died after
    ready closes the pipe, which poll() also reports)."""
    try:
        return pipe.recv() if pipe.poll() else None
    except EOFError:
        return None


def _watch(core: Any, frontends: list[Any], waiting_ready: list[Any], stopping: list[int], url: str) -> int:
    """Until every front end has exited; returns the server's exit status."""
    model = None
    core_died_at = None
    while True:
        alive = [p for p in frontends if p.exitcode is None]
        if not alive:
            break
        watched = [p.sentinel for p in alive] + waiting_ready + ([core.sentinel] if core_died_at is None else [])
        for ready in wait(watched, timeout=1.0):
            if ready in waiting_ready:
                waiting_ready.remove(ready)
                try:
                    model = ready.recv()
                except EOFError:  # that front end exited before it was ready
                    continue
                if not waiting_ready:
                    print(f"graphserve ready: {url}/v1 (model {model})", flush=True)
        if core_died_at is None and core.exitcode is not None and not stopping:
            logger.error("the engine core exited with status %s; stopping the server", core.exitcode)
            core_died_at = time.monotonic()
        if core_died_at is not None and time.monotonic() - core_died_at > CHILD_EXIT_GRACE_S:
            break
        failed = [p for p in frontends if p.exitcode not in (None, 0)]
        if failed and not stopping and core_died_at is None:
            logger.error("front end %s exited with status %s; stopping the server", failed[0].name,
                         failed[0].exitcode)
            return 1
    if core_died_at is not None or any(p.exitcode != 0 for p in frontends):
        return 1
    return 0


def stop_process(process: Any, signum: int, timeout: float = 10.0) -> None:
    if process.exitcode is None:
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            pass
        process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
