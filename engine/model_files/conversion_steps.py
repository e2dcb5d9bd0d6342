"""How a one-time model conversion runs: numbered, timed progress lines; every core for torch
while it lasts; transformers' progress bars silenced unless progress is asked for."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from graphserve.engine.model_files.model_cache import say


class Steps:
    """Numbered progress lines with timings ("[2/5] dequantizing ... done in 17.9 s"), logged to
    ``log`` (and printed with ``progress`` when INFO is not shown)."""

    def __init__(self, total: int, progress: bool, log: logging.Logger):
        self.total, self.progress, self.log, self.index = total, progress, log, 0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.index += 1
        t0 = time.perf_counter()
        say(self.log, f"[{self.index}/{self.total}] {what} ...", self.progress)
        yield
        say(self.log, f"[{self.index}/{self.total}] {what}: done in {time.perf_counter() - t0:.1f} s", self.progress)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


@contextlib.contextmanager
def all_cores_for_torch() -> Iterator[None]:
    """Use every core this process may run on during the conversion, then restore."""
    import torch

    before = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def quiet_transformers_progress(gguf_module, enabled: bool) -> Iterator[None]:
    """Silence transformers' own progress bars when progress=False: its shared switch, and the
    GGUF reader's bar, which uses tqdm directly."""
    if enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    original = getattr(gguf_module, "tqdm", None)
    if original is not None:

        def silent(*args, **kwargs):
            kwargs["disable"] = True
            return original(*args, **kwargs)

        gguf_module.tqdm = silent
    try:
        yield
    finally:
        if original is not None:
            gguf_module.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()
