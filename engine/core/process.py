"""The engine-core process: `start_core_process(config)` spawns it; it binds the core's
socket, loads the model and runs CoreLoop until it is stopped (SIGTERM from the server's
supervisor) or its parent dies (it is killed with its parent, so no orphan holds the GPU).
A failure to start or an engine error exits non-zero; the front ends see the exit. What stopped it
from starting goes to the supervisor as one line (`startup_failure`), which it prints last.

With tensor_parallel_size N > 1 it is rank 0 and spawns ranks 1..N-1 (engine/core/rank_worker.py),
each of which dies with it; it dies as soon as one of them has."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from graphserve.engine import gc_stats
from graphserve.engine.child_process import (
    die_with_parent,
    dump_stacks_on_sigusr1,
    freeze_startup_objects,
)
from graphserve.engine.config import EngineConfig
from graphserve.engine.errors import GraphserveError

logger = logging.getLogger("graphserve.engine")


def new_core_address() -> str:
    """A socket path in a folder of its own; remove_core_address removes both."""
    return f"ipc://{tempfile.mkdtemp(prefix='graphserve-')}/core"


def remove_core_address(address: str) -> None:
    shutil.rmtree(Path(address.removeprefix("ipc://")).parent, ignore_errors=True)


def startup_failure(exc: BaseException) -> str:
    """One line naming what stopped the engine from starting: the message of an error graphserve
    raised on purpose (a model it cannot serve, a setting this machine cannot take), else the type too."""
    return str(exc) if isinstance(exc, GraphserveError) else f"{type(exc).__name__}: {exc}"


def run_core(config: EngineConfig, address: str, parent_pid: int, log_level: int,
             failure: Connection | None = None) -> None:
    """The process's entry point. A failure to start is sent on `failure` (startup_failure's line)."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops us in order
    dump_stacks_on_sigusr1()
    gc_stats.watch()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s",
                        datefmt="%H:%M:%S")
    import zmq
    from graphserve.engine.core.engine_core import EngineCore
    from graphserve.engine.core.loop import CoreLoop, bind_core_socket

    context = zmq.Context()
    socket = bind_core_socket(context, address)
    workers, init_method = start_tp_workers(config, log_level)
    try:
        core = EngineCore(config, 0, init_method)
    except BaseException as exc:
        if isinstance(exc, GraphserveError):  # a cause the user can act on: its line says it all
            logger.error("the engine core failed to start: %s", exc)
        else:
            logger.exception("the engine core failed to start")
        if failure is not None:
            failure.send(startup_failure(exc))
        os._exit(1)
    freeze_startup_objects()
    loop = CoreLoop(core, socket, workers)
    dump_stacks_on_sigusr1(then=loop.wake_ranks)  # from now on the dump also wakes the other ranks
    try:
        loop.run()
    except BaseException:
        os._exit(1)  # CoreLoop logged it and told the front ends
    socket.close()
    context.term()


def start_tp_workers(config: EngineConfig, log_level: int) -> tuple[list[BaseProcess], str | None]:
    """Ranks 1..N-1 of a tensor-parallel engine, and the ranks' rendezvous (None for one rank)."""
    if config.tensor_parallel_size <= 1:
        return [], None
    from graphserve.engine.core.rank_worker import run_worker
    from graphserve.engine.distributed import local_init_method

    init_method = local_init_method()
    context = multiprocessing.get_context("spawn")
    workers = []
    for rank in range(1, config.tensor_parallel_size):
        process = context.Process(target=run_worker, args=(config, rank, init_method, os.getpid(), log_level),
                                  name=f"graphserve-rank{rank}", daemon=True)
        process.start()
        workers.append(process)
    return workers, init_method


def start_core_process(config: EngineConfig) -> tuple[BaseProcess, str, Connection]:
    """Spawn the engine core; returns the process, the address its socket binds, and the end of a
    pipe on which it sends what stopped it from starting, if anything did."""
    address = new_core_address()
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=run_core, args=(config, address, os.getpid(), logging.getLogger().getEffectiveLevel(), sender),
        name="graphserve-core", daemon=False)
    process.start()
    sender.close()
    return process, address, receiver
