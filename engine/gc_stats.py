"""Full garbage collections of this process: how many, and how long they took. The engine
core's /metrics report them (graphserve_core_gc_full_collections, _seconds): a full
collection stops the core's loop, and every request in flight waits for it.

`watch()` is called once by the engine-core process; until then `totals()` stays at zero.
`paused()` keeps collections out of a block (CUDA-graph capture)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

_FULL = 2  # the oldest generation: a full collection
_totals = [0, 0.0]  # collections, seconds
_started_at: float | None = None


def _on_collection(phase: str, info: dict) -> None:
    global _started_at
    if info.get("generation") != _FULL:
        return
    if phase == "start":
        _started_at = time.perf_counter()
    elif _started_at is not None:
        _totals[0] += 1
        _totals[1] += time.perf_counter() - _started_at
        _started_at = None


def watch() -> None:
    """Count this process's full collections from now on (idempotent)."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def totals() -> tuple[int, float]:
    """(full collections, their seconds) since watch()."""
    return _totals[0], _totals[1]


@contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block. CUDA-graph capture runs in one: a collection that
    frees CUDA memory (another engine's graph pool, in a process that made several) calls cudaFree,
    which invalidates the capture (torch.cuda.graph collects before each capture begins, not during)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
