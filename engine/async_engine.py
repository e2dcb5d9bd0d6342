"""AsyncEngine: the asyncio face of the engine, in a front end. It checks prompts, sends
them to the engine core, turns the core's token ids into text deltas (incremental
detokenizer, stop strings) and hands each request its updates, one per engine round.

The core runs in its own process when serving (`core_address` and `core_pid` given by
server/supervisor.py), or in a thread of this process (tests, servers built in-process):
the same loop and the same messages over the same kind of socket either way."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from graphserve.engine.config import EngineConfig
from graphserve.engine.core.client import CoreClient
from graphserve.engine.core.messages import (
    Abort,
    AddRequest,
    CoreDied,
    CoreReady,
    Hello,
    InjectFault,
    RoundOutputs,
    Shutdown,
)
from graphserve.engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from graphserve.engine.inputs import InputProcessor, ModelLimits
from graphserve.engine.output import OutputProcessor
from graphserve.engine.sched.prefix_hash import adapter_root, prompt_keys
from graphserve.engine.request import LoraRequest, RequestOutput, SamplingParams
from graphserve.engine.stats import EngineStats
from graphserve.engine.structured.grammar import GrammarCompiler, GrammarSpec
from graphserve.engine.tokenizer import Tokenizer

logger = logging.getLogger("graphserve.engine")


class AsyncEngine:
    def __init__(self, config: EngineConfig, core_address: str | None = None, core_pid: int | None = None):
        self.config = config
        self._core_address = core_address
        self._core_pid = core_pid
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None  # the core loop, when it runs in this process
        self._client: CoreClient | None = None
        self._reader: asyncio.Task | None = None
        self._pidfd: int | None = None
        self._core_ready: asyncio.Future[CoreReady] | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats = EngineStats()
        self._stopping = False
        self.info: CoreReady | None = None
        self.tokenizer: Tokenizer | None = None
        self.inputs: InputProcessor | None = None
        self.outputs: OutputProcessor | None = None
        self.grammars: GrammarCompiler | None = None
        self.dead = False
        self.error: BaseException | None = None

    # ---- life cycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the core (starting it in a thread of this process if no address was
        given) and wait until its model is loaded. Raises what stopped the core from starting."""
        self._loop = asyncio.get_running_loop()
        self._core_ready = self._loop.create_future()
        address = self._core_address
        if address is None:
            from graphserve.engine.core.process import new_core_address

            address = new_core_address()
            self._thread = threading.Thread(target=self._run_core_thread, args=(address,),
                                            name="graphserve-engine", daemon=True)
            self._thread.start()
        if self._core_pid is not None:
            try:
                self._pidfd = os.pidfd_open(self._core_pid)
            except ProcessLookupError:  # it failed to start before we got here
                raise EngineDeadError("the engine core process exited before it was ready") from None
            self._loop.add_reader(self._pidfd, self._core_gone,
                                  EngineDeadError("the engine core process exited"))
        self._client = CoreClient(address)
        self._reader = asyncio.create_task(self._read())
        self._client.send(Hello())
        info = await self._core_ready
        self.tokenizer = await asyncio.to_thread(Tokenizer, info.model_path)
        self.inputs = InputProcessor(self.tokenizer, ModelLimits(info.max_model_len, info.vocab_size))
        self.outputs = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(info.model_path, info.vocab_size, info.eos_token_ids,
                                        self.config.grammar_compile_timeout)
        self.grammars.warm()
        self._stats = info.stats
        self.info = info

    def _run_core_thread(self, address: str) -> None:
        import zmq

        from graphserve.engine.core.engine_core import EngineCore
        from graphserve.engine.core.loop import CoreLoop, bind_core_socket
        from graphserve.engine.core.process import remove_core_address

        context = zmq.Context()
        socket = bind_core_socket(context, address)
        try:
            CoreLoop(EngineCore(self.config), socket).run()
        except BaseException as exc:
            self._loop.call_soon_threadsafe(self._core_gone, exc)
        finally:
            socket.close()
            context.term()
            remove_core_address(address)

    @property
    def ready(self) -> bool:
        return self.info is not None and not self.dead and not self._stopping

    async def shutdown(self) -> None:
        self._stopping = True
        if self._client is not None and self._thread is not None:
            self._client.send(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.grammars is not None:
            self.grammars.close()

    # ---- facts the server needs --------------------------------------------------------

    @property
    def model_path(self) -> str:
        return self.info.model_path

    @property
    def model_name(self) -> str:
        return Path(self.info.model_path).name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def stats(self) -> EngineStats:
        """The core's latest figures (it sends them when they change, at most every 0.1 s)."""
        return self._stats

    # ---- requests ------------------------------------------------------------------------

    async def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile `spec` here first (in a worker thread, bounded in time), so a grammar that
        is malformed, fails to compile or takes too long is a 400 before anything is queued."""
        await self.grammars.check(spec)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                    max_tokens_defaulted: bool = False, lora: LoraRequest | None = None) -> "RequestStream":
        """Check the prompt, fit max_tokens (InputProcessor.check) and send now (raises
        InvalidRequestError / PromptTooLongError before the request takes any KV); returns the
        stream of its updates, one per engine round. `params` come validated
        (SamplingParams.validate, at the HTTP edge); `max_tokens_defaulted`: see fit_max_tokens.
        Closing the stream before the last update, read or not, aborts the request. lora: the LoRA
        adapter it runs with (the engine reads it when a request first needs it)."""
        if self.dead:
            raise EngineDeadError("the engine has stopped after an error")
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        token_ids, params = self.inputs.check(prompt, params, max_tokens_defaulted=max_tokens_defaulted)
        updates: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = updates
        self.outputs.add(request_id, token_ids, params)
        root = self.info.prefix_cache_root  # echo's prompt logprobs bypass the cache: no lookup
        hashed = root is not None and params.prompt_logprobs is None
        lora_id = lora.lora_id if lora is not None else None
        keys = prompt_keys(token_ids, self.info.block_size, adapter_root(root, lora_id)) if hashed else None
        self._client.send(AddRequest(request_id, token_ids, params, keys, lora))
        return RequestStream(self, request_id, updates)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """add_request + iterate: validation errors surface at the first __anext__."""
        async for out in self.add_request(prompt, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        """Idempotent; the core frees the request's blocks before its next step. Call it
        from the event loop."""
        self._queues.pop(request_id, None)
        if self.outputs is not None:
            self.outputs.discard(request_id)
        if self._client is not None and not self.dead:
            self._client.send(Abort([request_id]))

    def _release(self, request_id: str, finished: bool) -> None:
        if finished:
            self._queues.pop(request_id, None)
        else:
            self.abort(request_id)

    def inject_fault(self, kind: str) -> None:
        """Tests only: see EngineCore.inject_fault."""
        self._client.send(InjectFault(kind))

    # ---- what the core sends -------------------------------------------------------------

    async def _read(self) -> None:
        try:
            while True:
                message = await self._client.receive()
                if isinstance(message, RoundOutputs):
                    self._dispatch(message)
                elif isinstance(message, CoreReady):
                    if not self._core_ready.done():
                        self._core_ready.set_result(message)
                elif isinstance(message, CoreDied):
                    self._core_gone(EngineDeadError(f"engine error: {message.error}"))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a frame we cannot read: nothing after it can be trusted
            logger.exception("reading from the engine core failed")
            self._core_gone(exc)

    def _dispatch(self, message: RoundOutputs) -> None:
        if message.stats is not None:
            self._stats = message.stats
        stopped = []
        for out in message.outputs:
            processed = self.outputs.process(out)
            if processed is None:  # aborted here while the core was still working on it
                continue
            update, stopped_here = processed
            if stopped_here:
                stopped.append(out.request_id)
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(update)
        if stopped:  # a stop string: the core cannot know, so it must be told to end these
            self._client.send(Abort(stopped))

    def _core_gone(self, error: BaseException) -> None:
        """The core failed to start, or stopped: fail whatever waits on it."""
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
        if self._core_ready is not None and not self._core_ready.done():
            self._core_ready.set_exception(error)
            return
        if self.dead or self._stopping:
            return
        logger.error("the engine core stopped: %r", error)
        self.error, self.dead = error, True
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(f"engine error: {type(error).__name__}"))


class RequestStream:
    """The updates of one request: an async iterator whose aclose() aborts the request
    (also when nothing was read yet)."""

    def __init__(self, engine: AsyncEngine, request_id: str, updates: asyncio.Queue):
        self._engine = engine
        self.request_id = request_id
        self._updates = updates
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._updates.get()
        except BaseException:  # cancelled while waiting: the caller is gone
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._finish(True)
            raise item
        if item.finish_reason == "error":
            self._finish(True)
            if item.request_at_fault:
                raise InvalidRequestError(item.error)
            raise RequestFailedError(item.error or f"the engine step serving request {self.request_id} failed")
        if item.finished:
            self._finish(True)
        return item

    def _finish(self, finished: bool) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self.request_id, finished)

    async def aclose(self) -> None:
        self._finish(False)
