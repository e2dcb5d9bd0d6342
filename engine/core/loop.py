"""CoreLoop: serves one EngineCore to its front ends over a ZeroMQ ROUTER socket.

A busy loop, no asyncio: take whatever arrived without blocking (new requests, aborts),
run one engine step, send each front end one RoundOutputs with its requests' new tokens.
With nothing to run it blocks on the socket, waking every STATS_INTERVAL_S to send
fresh stats. Under tensor parallelism this is rank 0: before each step it sends the other
ranks (engine/core/rank_worker.py) what it took since the last one (StepInputs), and it dies as
soon as one of them has. It runs in its own process when serving (engine/core/process.py), or in a
thread of the front end's process (tests, `AsyncEngine` without a core address).
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq
from graphserve.engine.core.engine_core import EngineCore
from graphserve.engine.core.messages import (
    Abort,
    AddRequest,
    CoreDied,
    CoreOutput,
    CoreReady,
    Hello,
    InjectFault,
    RoundOutputs,
    Shutdown,
    StepInputs,
    decode_to_core,
    encode,
)
from graphserve.engine.errors import InvalidRequestError

logger = logging.getLogger("graphserve.engine")

STATS_INTERVAL_S = 0.1


def bind_core_socket(context: zmq.Context, address: str) -> zmq.Socket:
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.SNDHWM, 0)  # never drop a round's outputs for a front end that reads late
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(address)
    return socket


class CoreLoop:
    def __init__(self, core: EngineCore, socket: zmq.Socket, workers: list | None = None):
        self.core = core
        self.socket = socket
        self.workers = workers or []  # the other tensor-parallel ranks' processes
        self._inputs = StepInputs()  # for them: what this rank took since its last step
        self.frontends: set[bytes] = set()  # identities of the front ends that said Hello
        self.owner: dict[str, bytes] = {}  # request id -> the front end that sent it
        self._stopping = False
        # SIGUSR1 handler calls (counted: the handler runs between any two bytecodes of the loop)
        self._wake_requests = 0
        self._wakes_sent = 0
        self._stats_sent_at = 0.0
        self._last_stats = None

    def run(self) -> None:
        """Until a Shutdown message; an exception from the engine is sent to every front end
        (CoreDied) and re-raised."""
        core = self.core
        core.structured.compiler.warm()
        # the ranks of tensor parallelism take messages only between steps
        if not self.workers:
            core.on_wait = self._while_waiting
        try:
            while not self._stopping:
                self._receive(wait=not core.has_unfinished())
                self._check_workers()
                stepping = core.has_unfinished() and not self._stopping
                wakes = self._wake_requests
                if self.workers and (stepping or wakes != self._wakes_sent):
                    self._inputs.wake_only = not stepping
                    self._send_step_inputs()
                self._wakes_sent = wakes
                if stepping:
                    self._send_outputs(core.step())
                self._send_stats()
            if self.workers:
                self._inputs.stop = True
                self._send_step_inputs()
        except BaseException as exc:
            logger.exception("engine core loop died")
            self._broadcast(CoreDied(f"{type(exc).__name__}: {exc}"))
            raise

    def wake_ranks(self) -> None:
        """Have the other ranks leave their wait for this rank's next step (a step-less
        StepInputs, from the loop within STATS_INTERVAL_S): from the SIGUSR1 handler, so that
        theirs, which runs only once their main thread leaves the collective, dumps too."""
        self._wake_requests += 1

    def _while_waiting(self, outputs: list[CoreOutput]) -> None:
        """EngineCore.on_wait: send what the step has made so far, take what has arrived."""
        if outputs:
            self._send_outputs(outputs)
        self._receive(wait=False)

    def _check_workers(self) -> None:
        dead = [w for w in self.workers if not w.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank process {dead[0].name} exited with code {dead[0].exitcode}")

    def _send_step_inputs(self) -> None:
        if self.workers:
            self.core.tp.broadcast_bytes(encode(self._inputs))
            self._inputs = StepInputs()

    def _receive(self, wait: bool) -> None:
        if wait and not self.socket.poll(int(STATS_INTERVAL_S * 1000)):
            return
        while True:
            try:
                identity, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode_to_core(frame)
            except msgspec.ValidationError:  # a request the core cannot take must not stop the core
                self._refuse(identity, frame)
                continue
            self._handle(identity, message)

    def _refuse(self, identity: bytes, frame: bytes) -> None:
        """A frame that fails the core's checks: an AddRequest ends with an error, anything else
        is dropped; both are logged (the front end checks requests first: this is a bug there)."""
        logger.exception("the engine core could not take a message from a front end")
        raw = msgspec.msgpack.decode(frame)
        if isinstance(raw, list) and len(raw) > 1 and raw[0] == "AddRequest" and isinstance(raw[1], str):
            self._send(identity, RoundOutputs([CoreOutput(raw[1], [], finish_reason="error",
                                                          error="the engine core refused the request")]))

    def _handle(self, identity: bytes, message) -> None:
        core = self.core
        if isinstance(message, AddRequest):
            try:
                seq = core.add_request(message.request_id, message.prompt_token_ids, message.params,
                                       message.prompt_block_keys, message.lora)
                if self.workers:
                    self._inputs.adds.append(message)
                    self._inputs.seeds.append(seq.seed)
            except InvalidRequestError:
                logger.exception("front end sent a request the core cannot take")
                self._send(identity, RoundOutputs([CoreOutput(message.request_id, [], finish_reason="error")]))
                return
            self.owner[message.request_id] = identity
        elif isinstance(message, Abort):
            for request_id in message.request_ids:
                core.abort(request_id)
                self.owner.pop(request_id, None)
            if self.workers:
                self._inputs.aborts += message.request_ids
        elif isinstance(message, Hello):
            self.frontends.add(identity)
            blocks = core.block_manager
            self._send(identity, CoreReady(core.model_path, core.max_model_len, core.args.vocab_size,
                                           list(core.eos_ids), core.stats(), blocks.block_size,
                                           blocks.root if blocks.prefix_caching else None, core.warmed_up))
        elif isinstance(message, InjectFault):
            core.inject_fault(message.kind)
            if self.workers:
                self._inputs.faults.append(message.kind)
        elif isinstance(message, Shutdown):
            self._stopping = True

    def _send_outputs(self, outputs: list[CoreOutput]) -> None:
        by_frontend: dict[bytes, list[CoreOutput]] = {}
        for out in outputs:
            identity = self.owner.pop(out.request_id) if out.finish_reason else self.owner.get(out.request_id)
            if identity is not None:
                by_frontend.setdefault(identity, []).append(out)
        for identity, outs in by_frontend.items():
            self._send(identity, RoundOutputs(outs))

    def _send_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_sent_at < STATS_INTERVAL_S:
            return
        self._stats_sent_at = now
        stats = self.core.stats()
        if stats != self._last_stats:
            self._last_stats = stats
            self._broadcast(RoundOutputs([], stats))

    def _broadcast(self, message) -> None:
        for identity in self.frontends:
            self._send(identity, message)

    def _send(self, identity: bytes, message) -> None:
        self.socket.send_multipart([identity, encode(message)], copy=False)
