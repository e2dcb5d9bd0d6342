"""CoreClient: a front end's connection to the engine core, one ZeroMQ DEALER socket
driven by the front end's asyncio loop."""

from __future__ import annotations

import zmq
import zmq.asyncio
from graphserve.engine.core.messages import FromCore, ToCore, decode_from_core, encode


class CoreClient:
    def __init__(self, address: str):
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # sends never block or drop: the core reads every round
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, message: ToCore) -> None:
        self.socket.send(encode(message), flags=zmq.NOBLOCK, copy=False)

    async def receive(self) -> FromCore:
        frame = await self.socket.recv(copy=False)
        return decode_from_core(frame.buffer)

    def close(self) -> None:
        self.socket.close()
        self.context.term()
