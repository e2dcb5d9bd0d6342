"""Run the engine requests behind one HTTP request (n choices x prompts) and merge
their output streams; abort all of them when the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import Request

from graphserve.engine.request import LoraRequest, RequestOutput, SamplingParams
from graphserve.server.admission import Admission
from graphserve.server.errors import APIError, from_engine_error, internal_error
from graphserve.server.metrics import ServerMetrics
from graphserve.server.request_params import summarize_params

logger = logging.getLogger("graphserve.server")

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the response was complete."""


@dataclass
class ChoiceJob:
    """One engine request: choice `index` of the response."""

    index: int
    prompt: str | list[int]
    params: SamplingParams
    max_tokens_defaulted: bool = False  # the body left max_tokens out (engine/inputs.fit_max_tokens)
    lora: LoraRequest | None = None  # the LoRA adapter the body's `model` named


@dataclass
class ChoiceProgress:
    """What the server tracks per choice for metrics, usage and the final response."""

    arrival_time: float
    first_token_time: float | None = None
    core_times: tuple[float, float] | None = None  # RequestOutput.core_times
    # the whole output so far when the group keeps outputs (a response sent at the end),
    # else only the latest update (a stream sends each update as it comes)
    output: RequestOutput | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    done: bool = False


@dataclass
class _Pump:
    """One engine request's output stream and the task reading its next output."""

    stream: AsyncIterator[RequestOutput]
    task: asyncio.Future[RequestOutput] | None = None
    queued: bool = True  # counted by Admission until its first output (or its end)
    closed: bool = field(default=False)


class GenerationGroup:
    """The engine requests of one HTTP request. Whoever starts it must `close()` it, which
    aborts whatever is still running."""

    def __init__(
        self,
        engine: Any,
        request_id: str,
        jobs: list[ChoiceJob],
        metrics: ServerMetrics,
        admission: Admission,
        log_requests: bool = False,
        keep_outputs: bool = True,
    ):
        self.engine = engine
        self.keep_outputs = keep_outputs
        self.request_id = request_id
        self.jobs = jobs
        self.metrics = metrics
        self.admission = admission
        self.log_requests = log_requests
        self.progress: dict[int, ChoiceProgress] = {}
        self._pumps: dict[int, _Pump] = {}
        self._interrupted: APIError | None = None

    def engine_request_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    async def start(self) -> None:
        """Admit (429 when the queue is full), then validate and submit every job.

        `engine.add_request` checks a prompt (length, empty, ids) before it is queued, so
        a bad request becomes a 4xx before any response header is sent, and any job of
        the group that was already submitted is aborted.
        """
        self.admission.admit(len(self.jobs))
        self.admission.active.add(self)
        now = time.monotonic()
        try:
            for job in self.jobs:
                stream = self.engine.add_request(job.prompt, job.params, self.engine_request_id(job.index),
                                                 max_tokens_defaulted=job.max_tokens_defaulted, lora=job.lora)
                self.progress[job.index] = ChoiceProgress(arrival_time=now)
                # read at once: a started stream aborts its request when it is cancelled or closed
                pump = _Pump(stream, task=asyncio.ensure_future(anext(stream)))
                self._pumps[job.index] = pump
                self.admission.enter()
        except Exception as exc:
            await self.close(record=False)  # a rejected request is an error, not an abort
            raise as_api_error(exc, self.request_id) from None
        if self.log_requests:
            job = self.jobs[0]
            logger.info(
                "request %s: %d choice(s), prompt %.200r, params %s",
                self.request_id,
                len(self.jobs),
                job.prompt,
                summarize_params(job.params),
            )

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (choice index, output) as the engine produces them, until all finish."""
        while True:
            waiting = {pump.task: index for index, pump in self._pumps.items() if pump.task is not None}
            if not waiting:
                return
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if self._interrupted is not None:
                raise self._interrupted
            for task in sorted(done, key=lambda t: waiting[t]):
                index = waiting[task]
                pump = self._pumps[index]
                pump.task = None
                self._dequeue(pump)
                try:
                    output = task.result()
                except Exception as exc:
                    raise as_api_error(exc, self.request_id) from exc
                self._record(index, output)
                if not output.finished:
                    pump.task = asyncio.ensure_future(anext(pump.stream))
                yield index, output

    async def collect(self) -> dict[int, ChoiceProgress]:
        """Run every choice to the end (non-streaming responses)."""
        async for _ in self.outputs():
            pass
        return self.progress

    def interrupt(self, error: APIError) -> None:
        """End the request now with `error` (the shutdown deadline passed): its engine
        requests are aborted; a stream ends with an error event, otherwise the error is
        the response."""
        self._interrupted = error
        for pump in self._pumps.values():
            if pump.task is not None and not pump.task.done():
                pump.task.cancel()  # the engine stream aborts its request as it unwinds

    def _dequeue(self, pump: _Pump) -> None:
        if pump.queued:
            pump.queued = False
            self.admission.leave()

    def _record(self, index: int, output: RequestOutput) -> None:
        progress = self.progress[index]
        if self.keep_outputs and progress.output is not None:
            progress.output.merge(output)
        else:
            progress.output = output
        progress.num_prompt_tokens = len(output.prompt_token_ids)
        progress.num_cached_tokens = max(progress.num_cached_tokens, output.num_cached_tokens)
        progress.num_output_tokens += len(output.token_ids)
        if progress.first_token_time is None and output.token_ids:
            progress.first_token_time = time.monotonic()
        progress.core_times = progress.core_times or output.core_times
        if output.finished and not progress.done:
            progress.done = True
            self._observe(index, output.finish_reason)

    def _observe(self, index: int, finish_reason: str | None) -> None:
        progress = self.progress[index]
        num_prompt, num_generated = progress.num_prompt_tokens, progress.num_output_tokens
        self.metrics.observe_finished(
            finish_reason=finish_reason,
            num_prompt_tokens=num_prompt,
            num_generated_tokens=num_generated,
            arrival_time=progress.arrival_time,
            first_token_time=progress.first_token_time,
            finish_time=time.monotonic(),
            core_times=progress.core_times,
            lora_name=self.jobs[0].lora.name if self.jobs[0].lora is not None else None,
        )
        if self.log_requests:
            logger.info(
                "request %s: %s, %d prompt + %d generated tokens",
                self.engine_request_id(index),
                finish_reason,
                num_prompt,
                num_generated,
            )

    async def close(self, record: bool = True) -> None:
        """Abort every unfinished engine request and close its stream. Idempotent.

        The synchronous part (abort, metrics, queue count) runs first and the awaits are
        shielded: Starlette cancels a stream's task with an anyio cancel scope, which
        would cancel every await of this cleanup again.
        """
        self.admission.active.discard(self)
        for index, pump in self._pumps.items():
            self._dequeue(pump)
            progress = self.progress[index]
            if not progress.done:
                self.engine.abort(self.engine_request_id(index))
                progress.done = True
                if record:
                    self._observe(index, "abort")
        pending = [pump.task for pump in self._pumps.values() if pump.task is not None and not pump.task.done()]
        with anyio.CancelScope(shield=True):
            if pending:
                await asyncio.sleep(0)  # let a just-created reader start, so that cancelling it closes its stream
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            for index, pump in self._pumps.items():
                if pump.task is not None and pump.task.done() and not pump.task.cancelled():
                    pump.task.exception()  # mark retrieved: the error was already reported or is moot
                pump.task = None
                if not pump.closed:
                    pump.closed = True
                    try:
                        await pump.stream.aclose()  # type: ignore[attr-defined]
                    except Exception:
                        logger.debug("closing engine stream %s failed", self.engine_request_id(index), exc_info=True)


def as_api_error(exc: Exception, request_id: str) -> APIError:
    """What the client sees of `exc`; a server-side failure (5xx) is logged with its traceback.
    StopAsyncIteration: an engine stream that ended before its final output."""
    if isinstance(exc, APIError):
        return exc
    error = internal_error() if isinstance(exc, StopAsyncIteration) else from_engine_error(exc)
    if error.status_code >= 500:
        logger.error("request %s failed: %r", request_id, exc, exc_info=exc)
    return error


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (closing its engine streams) if the client leaves first."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        raise ClientDisconnected()  # the finally cancels the work first
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)


async def start_generation(state: Any, request_id: str, jobs: list[ChoiceJob], stream: bool) -> GenerationGroup:
    """Submit the jobs (a full queue raises 429, a rejected prompt a 4xx APIError). A
    stream's group keeps only each choice's latest update; otherwise whole outputs."""
    group = GenerationGroup(state.engine, request_id, jobs, state.metrics, state.admission, state.log_requests,
                            keep_outputs=not stream)
    await group.start()
    return group


async def run_to_completion(request: Request, group: GenerationGroup) -> dict[int, ChoiceProgress]:
    """Non-streaming: collect every choice, aborting all of them if the client leaves."""
    try:
        return await cancel_on_disconnect(request, group.collect())
    finally:
        await group.close()
