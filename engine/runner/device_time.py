"""DeviceTimeline: how long the device computed, and how long it sat idle between
batches while requests were running (waiting for the host: scheduling, token copies,
the front ends). On CUDA the times come from events recorded on the stream around each
batch, so a round launched ahead of time shows no gap; on CPU, where work runs
synchronously, from the host clock."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class DeviceTimeline:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.busy_seconds = 0.0
        self.idle_seconds = 0.0
        self._pending: deque[tuple[object, object, bool]] = deque()  # (start, end, follows the previous batch)
        self._last_end: object | None = None
        self._chained = False
        self._spare: list[torch.cuda.Event] = []

    def _mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> tuple[object, bool]:
        """Before the host queues a batch. Returns a token for end()."""
        return self._mark(), self._chained

    def end(self, token: tuple[object, bool]) -> None:
        """After the host queued the batch (CUDA) or ran it (CPU)."""
        start, chained = token
        self._pending.append((start, self._mark(), chained))
        self._chained = True
        self.poll()

    @contextmanager
    def busy(self) -> Iterator[None]:
        """begin() and end() around what the block queues (or runs)."""
        token = self.begin()
        try:
            yield
        finally:
            self.end(token)

    def pause(self) -> None:
        """No requests are running: the next gap is not the engine's idle time."""
        self._chained = False

    def poll(self) -> None:
        """Account for the batches the device has finished."""
        while self._pending:
            start, end, chained = self._pending[0]
            if self.cuda and not end.query():
                return
            self._pending.popleft()
            if chained and self._last_end is not None:
                self.idle_seconds += self._elapsed(self._last_end, start)
            self.busy_seconds += self._elapsed(start, end)
            if self.cuda:
                if self._last_end is not None:
                    self._spare.append(self._last_end)
                self._spare.append(start)
            self._last_end = end

    def _elapsed(self, start: object, end: object) -> float:
        if self.cuda:
            return max(0.0, start.elapsed_time(end) / 1000.0)
        return max(0.0, end - start)
