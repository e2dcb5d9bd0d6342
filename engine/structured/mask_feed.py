"""Grammar masks fed to decode rounds while they run, so constrained rows keep K-step
rounds (and rounds launched ahead) instead of one host round trip per token.

A round's K steps are queued at once. In a round with constrained rows each step is two
graphs, the forward pass and the masked sampling; between them this queues a wait for the
host (kernels/host_wait.py) and the copy of the step's masks into the static bitmask;
after the sampling, the copy of the constrained rows' tokens to the host. A worker thread
serves the rounds in order: for each step, once the tokens of the step before are on the
host (the last step of the round before, for the first step), the matchers take them and
write this step's masks (StructuredOutputs.advance), then it raises the counter the device
waits on. It does this while the device runs the step's forward pass, so the device waits
only when the matchers are slower than a forward pass, and the engine's own thread is free
to process the round before and launch the one after.

    device: fwd 0 | wait 0, masks 0 | sample 0, tokens 0 | fwd 1 | wait 1, masks 1 | sample 1 ...
    worker:   (tokens of the round before) -> masks 0 ^    tokens 0 -> masks 1 ^

Only the constrained rows' masks and tokens cross PCIe (`rows` says where they go). Token
copies are numbered across rounds; a ring of host buffers (and CUDA events) holds the last
few. On CPU (tests) the same protocol runs with the engine's thread doing the "device" part
synchronously, waiting on conditions instead of a kernel and events.

The worker needs the GIL for a few tens of microseconds per step; the engine's thread may
hold it for Python's switch interval (5 ms by default) before handing it over, so the
first feed lowers the process's switch interval to 0.2 ms."""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("graphserve.engine")

SWITCH_INTERVAL_S = 2e-4
HOST_TIMEOUT_S = 30.0  # a wait on the other side that long means it is gone


@dataclass
class FeedJob:
    """One round to serve. Compact row j is batch row rows[j] of seqs; lead_from[j]: its row
    among the compact rows of the round before (whose last tokens it continues from), or -1."""

    seqs: list
    rows: list[int]
    lead_from: list[int]
    lead_copy: int  # copy number of the round before's last tokens (-1: none so far)
    first_copy: int  # copy number of this round's first step
    first_wait: int  # counter value the device's first wait expects (then +1 per step)
    num_steps: int
    advance: Callable[[list, list[int], list[int | None], torch.Tensor], None]
    lead_done: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    cancelled: bool = False  # its round failed before all its copies were queued
    next: FeedJob | None = None  # the round submitted after it


class MaskFeed:
    def __init__(self, max_rows: int, words: int, max_steps: int, device: torch.device):
        self.cuda = device.type == "cuda"
        pin = self.cuda
        self.ring = 2 * max_steps + 2  # token copies kept on the host
        self.counter = torch.zeros(1, dtype=torch.int64, pin_memory=pin)  # raised by the worker
        self.timeouts = torch.zeros(1, dtype=torch.int32, pin_memory=pin)  # device waits that gave up
        self.host_masks = torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin)
        self.host_tokens = torch.zeros(self.ring, max_rows, dtype=torch.int64, pin_memory=pin)
        self.device_masks = torch.full((max_rows, words), -1, dtype=torch.int32, device=device)
        self.events = [torch.cuda.Event() for _ in range(self.ring)] if self.cuda else []
        self.issued_waits = 0  # the counter value the last queued wait expects
        self.issued_copies = 0  # token copies queued so far
        self._recorded = 0  # token copies queued (CUDA) or done (CPU) that the worker may wait on
        self._cond = threading.Condition()
        self._jobs: queue.Queue[FeedJob | None] = queue.Queue()
        self._last_job: FeedJob | None = None
        self._timeouts_seen = 0
        self._thread: threading.Thread | None = None
        self._wait_for_host = None
        if self.cuda:
            from graphserve.kernels.host_wait import wait_for_host  # triton: imported where a GPU runs rounds

            self._wait_for_host = wait_for_host
            self._wait_for_host(self.counter, self.timeouts, 0)  # compiles the kernel now, not in a round

    # ---- the device side: queued by the engine's thread, in stream order -------------------

    def queue_masks(self, token_bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Before a step's sampling: wait for the worker's masks, then copy them into rows
        `rows` (device int64 [c]) of the static bitmask."""
        self.issued_waits += 1
        c = rows.shape[0]
        if self.cuda:
            self._wait_for_host(self.counter, self.timeouts, self.issued_waits)
            self.device_masks[:c].copy_(self.host_masks[:c], non_blocking=True)
            token_bitmask.index_copy_(0, rows, self.device_masks[:c])
            return
        expected = self.issued_waits
        with self._cond:
            if not self._cond.wait_for(lambda: int(self.counter[0]) >= expected, HOST_TIMEOUT_S):
                self.timeouts[0] += 1
        token_bitmask.index_copy_(0, rows, self.host_masks[:c].clone())

    def queue_tokens(self, step_tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """After a step's sampling: the constrained rows' tokens (of `step_tokens`, [B]) to the host."""
        slot = self.issued_copies % self.ring
        self.issued_copies += 1
        self.host_tokens[slot, :rows.shape[0]].copy_(step_tokens.index_select(0, rows), non_blocking=self.cuda)
        if self.cuda:
            self.events[slot].record()
        with self._cond:
            self._recorded = self.issued_copies
            self._cond.notify_all()

    def release_waits(self) -> None:
        """Let every queued device wait through (a round that failed half-queued)."""
        self._raise(self.issued_waits)

    # ---- the engine's thread: jobs -----------------------------------------------------------

    def submit(self, seqs: list, rows: list[int], lead_from: list[int], num_steps: int,
               advance: Callable[[list, list[int], list[int | None], torch.Tensor], None]) -> FeedJob:
        """Serve a round whose K waits and copies are queued next (CPU) or were just queued
        (CUDA: call after queueing, so its events are recorded first)."""
        first_copy = self.issued_copies - (num_steps if self.cuda else 0)
        first_wait = self.issued_waits - (num_steps if self.cuda else 0) + 1
        job = FeedJob(seqs, rows, lead_from, first_copy - 1 if first_copy > 0 else -1, first_copy, first_wait,
                      num_steps, advance)
        if self._thread is None:
            if sys.getswitchinterval() > SWITCH_INTERVAL_S:
                sys.setswitchinterval(SWITCH_INTERVAL_S)
            self._thread = threading.Thread(target=self._serve_forever, name="graphserve-mask-feed", daemon=True)
            self._thread.start()
        if self._last_job is not None:
            self._last_job.next = job
        self._last_job = job
        self._jobs.put(job)
        return job

    def cancel(self, job: FeedJob) -> None:
        """Its round failed half-queued: the worker stops waiting for its copies."""
        with self._cond:
            job.cancelled = True
            self._cond.notify_all()
        self.release_waits()

    def wait_taken(self, job: FeedJob) -> None:
        """Until the matchers took every token of `job`'s round they will take: its own steps
        and, when the round launched after it continues from it, its last ones. Raises what
        the worker raised."""
        next_job = job.next
        wait = next_job.lead_done if next_job is not None else job.done
        if not wait.wait(HOST_TIMEOUT_S):
            raise RuntimeError("the grammar mask worker did not finish a round in time")
        for j in (job, next_job):
            if j is not None and j.error is not None:
                raise RuntimeError("the grammar mask worker failed") from j.error

    def drain(self) -> None:
        """Until every submitted round is served (before the matchers are rolled back)."""
        if self._last_job is not None:
            self._last_job.done.wait(HOST_TIMEOUT_S)

    @property
    def last_job(self) -> FeedJob | None:
        return self._last_job

    def take_timeouts(self) -> int:
        """Device waits that gave up since the last call (each let a step sample with stale masks)."""
        total = int(self.timeouts[0])
        new, self._timeouts_seen = total - self._timeouts_seen, total
        return new

    # ---- the worker --------------------------------------------------------------------------

    def _serve_forever(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._serve(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the engine's thread
                logger.exception("grammar mask worker")
                job.error = exc
                self.release_waits()
            finally:
                job.lead_done.set()
                job.done.set()

    def _tokens(self, job: FeedJob, copy: int, count: int) -> list[int]:
        with self._cond:
            if not self._cond.wait_for(lambda: self._recorded > copy or job.cancelled, HOST_TIMEOUT_S):
                raise RuntimeError(f"token copy {copy} was never queued")
            if job.cancelled and self._recorded <= copy:
                raise RuntimeError("the round was cancelled")
        slot = copy % self.ring
        if self.cuda:
            self.events[slot].synchronize()
        return self.host_tokens[slot, :count].tolist()

    def _raise(self, value: int) -> None:
        with self._cond:
            counter = self.counter.numpy()
            counter[0] = max(int(counter[0]), value)
            self._cond.notify_all()

    def _serve(self, job: FeedJob) -> None:
        c = len(job.rows)
        masks = self.host_masks[:c]
        # the first step's masks; waiting for the last copy before also means the device has
        # copied the last masks out of host_masks
        before = self._tokens(job, job.lead_copy, max(job.lead_from, default=-1) + 1) if job.lead_copy >= 0 else []
        job.advance(job.seqs, job.rows, [before[p] if p >= 0 else None for p in job.lead_from], masks)
        self._raise(job.first_wait)
        job.lead_done.set()
        for step in range(job.num_steps - 1):
            tokens = self._tokens(job, job.first_copy + step, c)
            job.advance(job.seqs, job.rows, tokens, masks)
            self._raise(job.first_wait + step + 1)
