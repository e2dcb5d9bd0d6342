"""The engine-core process: `start_core_process(config)` spawns it; it binds the core's
socket, loads the model and runs CoreLoop until it is stopped (SIGTERM from the server's
supervisor) or its parent dies (it is killed with its parent, so no orphan holds the GPU).
A failure to start or an engine error exits non-zero; the front ends see the exit.

With tensor_parallel_size N > 1 it is rank 0 and spawns ranks 1..N-1 (engine/core/rank_worker.py),
each of which dies with it; it dies as soon as one of them has."""

from __future__ import annotations

import faulthandler
import gc
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from graphserve.engine import gc_stats
from graphserve.engine.config import EngineConfig

logger = logging.getLogger("graphserve.engine")


def die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent exits (no orphans);
    exit now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def dump_stacks_on_sigusr1(then: Callable[[], None] | None = None) -> None:
    """kill -USR1 PID: every thread's Python stack to stderr (the server's log); the process
    goes on. Every process the server spawns takes it, so `pkill -USR1 -f spawn_main` is safe.

    The dump runs as a Python signal handler: in the main thread, between two bytecodes, holding
    the GIL, so no other thread can change its stack while it is read. (faulthandler's own
    handler reads them from inside the signal, whatever runs: an engine core whose warm-up thread
    was importing xgrammar died of it with SIGSEGV, in 4 of 5 runs of 300 signals sent 20 ms apart,
    after 90-169 of them.) So a
    main thread inside a long native call dumps when it returns: a tensor-parallel rank waiting
    in a collective for rank 0's next step, which rank 0 sends on its own SIGUSR1 (`then`)."""

    def dump(signum: int, frame: object) -> None:
        faulthandler.dump_traceback(all_threads=True)
        if then is not None:
            then()

    signal.signal(signal.SIGUSR1, dump)


def freeze_startup_objects() -> None:
    """Once start-up is done: collect, then take every object alive now out of the garbage
    collector's sight (gc.freeze). A loaded model, captured CUDA graphs and compiled kernels are
    hundreds of thousands of objects that live as long as the process; otherwise each full
    collection walks them all (0.14-0.16 s for the CPU engine on a CI machine) while every
    request in flight waits."""
    gc.collect()
    gc.freeze()


def new_core_address() -> str:
    return f"ipc://{tempfile.mkdtemp(prefix='graphserve-')}/core"


def run_core(config: EngineConfig, address: str, parent_pid: int, log_level: int) -> None:
    """The process's entry point."""
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
    except BaseException:
        logger.exception("the engine core failed to start")
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
    from graphserve.engine.distributed import local_init_method
    from graphserve.engine.core.rank_worker import run_worker

    init_method = local_init_method()
    context = multiprocessing.get_context("spawn")
    workers = []
    for rank in range(1, config.tensor_parallel_size):
        process = context.Process(target=run_worker, args=(config, rank, init_method, os.getpid(), log_level),
                                  name=f"graphserve-rank{rank}", daemon=True)
        process.start()
        workers.append(process)
    return workers, init_method


def start_core_process(config: EngineConfig) -> tuple[BaseProcess, str]:
    """Spawn the engine core; returns the process and the address its socket binds."""
    address = new_core_address()
    process = multiprocessing.get_context("spawn").Process(
        target=run_core, args=(config, address, os.getpid(), logging.getLogger().getEffectiveLevel()),
        name="graphserve-core", daemon=False)
    process.start()
    return process, address
