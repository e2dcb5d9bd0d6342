"""AsyncEngine: the asyncio face of the engine. The engine loop runs in its own thread;
requests come in through a thread-safe queue and outputs go back to each request's
asyncio.Queue with call_soon_threadsafe (one call per step for all requests)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from engine.llm_engine import EngineStats, LLMEngine
from engine.request import RequestOutput, SamplingParams, Sequence

logger = logging.getLogger("graphserve.engine")


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine: LLMEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", Sequence) | ("abort", request_id)
        self._wakeup = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._stopping = False
        self.dead = False
        self.error: BaseException | None = None

    # ---- life cycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (in a worker thread, so the event loop keeps serving) and start the loop."""
        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(LLMEngine, self.config)
        self._thread = threading.Thread(target=self._run, name="graphserve-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.dead and not self._stopping

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ---- facts the server needs --------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def model_name(self) -> str:
        from pathlib import Path

        return Path(self.engine.model_path).name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        return self.engine.stats() if self.engine is not None else EngineStats()

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> "RequestStream":
        """Validate and enqueue now (raises InvalidRequestError / PromptTooLongError before the
        request takes any KV); returns the stream of its outputs, one per engine round.
        Closing the stream before the last output, read or not, aborts the request."""
        if self.dead:
            raise EngineDeadError("the engine has stopped after an error")
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seq: Sequence = self.engine.make_sequence(request_id, prompt, params)
        outputs: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = outputs
        self._inbox.put(("add", seq))
        self._wakeup.set()
        return RequestStream(self, request_id, outputs)

    def _release(self, request_id: str, finished: bool) -> None:
        self._queues.pop(request_id, None)
        if not finished:
            self.abort(request_id)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """add_request + iterate: validation errors surface at the first __anext__."""
        async for out in self.add_request(prompt, params, request_id):
            yield out

    def inject_fault(self, kind: str) -> None:
        """Tests only: see LLMEngine.inject_fault."""
        self.engine.inject_fault(kind)
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; the engine frees the request's blocks before its next step."""
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    # ---- the engine thread ----------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                if item.request_id in self._queues:  # not closed while queued
                    self.engine.add_sequence(item)
            else:
                self.engine.abort(item)

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox()
                if not engine.has_unfinished():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                outputs = engine.step()
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as e:  # the loop cannot go on: fail every waiting request
            logger.exception("engine loop died")
            self.error, self.dead = e, True
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine error: {type(e).__name__}"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(error)


class RequestStream:
    """The outputs of one request: an async iterator whose aclose() aborts the request
    (also when nothing was read yet)."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue):
        self._engine = engine
        self.request_id = request_id
        self._outputs = outputs
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._outputs.get()
        except BaseException:  # cancelled while waiting: the caller is gone
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._finish(True)
            raise item
        if item.finish_reason == "error":
            self._finish(True)
            raise RequestFailedError(f"the engine step serving request {self.request_id} failed")
        if item.finished:
            self._finish(True)
        return item

    def _finish(self, finished: bool) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self.request_id, finished)

    async def aclose(self) -> None:
        self._finish(False)
