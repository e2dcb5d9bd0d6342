"""FaultInjector: the engine faults tests inject (a step's model run, one request's batches, the engine itself)."""

from __future__ import annotations

from collections.abc import Iterable

from graphserve.engine.request import Sequence


class FaultInjector:
    def __init__(self):
        self._injected_fault: str | None = None
        self._poisoned: set[str] = set()  # requests whose every batch fails

    def inject(self, kind: str, request_id: str | None, running: Iterable[str]) -> None:
        """Kinds: "step": the next step's model run raises for every request in it (they fail, the engine
        goes on); "request": every batch holding `request_id` (default: the newest of `running`)
        raises, so it fails alone and its batch mates are retried; "fatal": the engine's own
        bookkeeping raises (the engine dies)."""
        if kind == "request":
            if request_id is None:
                request_id = next(reversed(list(running)), None)
            if request_id is not None:
                self._poisoned.add(request_id)
            return
        if kind not in ("step", "fatal"):
            raise ValueError(f"unknown fault kind {kind!r}")
        self._injected_fault = kind

    def take_fatal(self) -> None:
        """Raise if a fatal fault was injected (once)."""
        if self._injected_fault == "fatal":
            self._injected_fault = None
            raise RuntimeError("injected fatal engine fault")

    def check_step(self, seqs: list[Sequence]) -> None:
        """Raise if the model run of a batch of `seqs` is to fail."""
        if self._injected_fault == "step":
            self._injected_fault = None
            self._poisoned.update(s.request_id for s in seqs)
        if self._poisoned and any(s.request_id in self._poisoned for s in seqs):
            raise RuntimeError("injected step fault")

    def forget(self, request_id: str) -> None:
        """The request failed: its later batches (a retry alone) run."""
        self._poisoned.discard(request_id)
