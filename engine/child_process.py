"""What every process the server spawns does first (front ends, the engine core, tensor-parallel
ranks): die with its parent, dump its stacks on SIGUSR1, and, once started, take its long-lived
objects out of the garbage collector's sight."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable


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
    the GIL. So a main thread inside a long native call dumps when it returns: a tensor-parallel
    rank waiting in a collective for rank 0's next step, which rank 0 sends on its own SIGUSR1
    (`then`).

    The threads come from sys._current_frames(), which reads the interpreter's list of threads
    under its lock; not from faulthandler, whose asynchronous handler reads running threads'
    stacks and whose dump_traceback walks that list unlocked. Holding the GIL does not keep the
    list still: a native thread entering Python (gloo's worker, dropping the last reference to a
    collective's tensors: every tensor-parallel step) links its new thread state in before
    initialising it, without the GIL, and dump_traceback read its NULL frame pointer: SIGSEGV."""
    dumping = False

    def dump(signum: int, frame: object) -> None:
        nonlocal dumping
        # a signal during a dump is served by it: the dump is Python, so handlers run inside it, even
        # inside sys._current_frames (a collection there), whose lock a second call would wait for forever
        if dumping:
            return
        dumping = True
        try:
            _write_stacks()
            if then is not None:
                then()
        finally:
            dumping = False

    signal.signal(signal.SIGUSR1, dump)


def _write_stacks() -> None:
    """faulthandler's format, straight to file descriptor 2: sys.stderr's buffer may be held by the
    very code the signal interrupted."""
    current = threading.get_ident()
    lines = []
    for ident, top in sys._current_frames().items():
        name = "Current thread" if ident == current else "Thread"
        lines.append(f"{name} 0x{ident:016x} (most recent call first):")
        for frame, lineno in traceback.walk_stack(top):
            lines.append(f'  File "{frame.f_code.co_filename}", line {lineno} in {frame.f_code.co_name}')
        lines.append("")
    data = "\n".join(lines).encode(errors="backslashreplace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:  # no stderr: nothing to print to
        pass


def freeze_startup_objects() -> None:
    """Once start-up is done: collect, then take every object alive now out of the garbage
    collector's sight (gc.freeze). A loaded model, captured CUDA graphs and compiled kernels are
    hundreds of thousands of objects that live as long as the process; otherwise each full
    collection walks them all (0.14-0.16 s for the CPU engine on a CI machine) while every
    request in flight waits."""
    gc.collect()
    gc.freeze()
