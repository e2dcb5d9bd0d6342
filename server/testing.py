"""Run a real graphserve server (uvicorn, loopback, free port) in a background thread.

For tests and benchmarks:

    with BackgroundServer(create_app(AsyncEngine(EngineConfig(device="cpu")))) as server:
        server.wait_ready()
        httpx.get(server.url + "/health")
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import httpx
import uvicorn
from fastapi import FastAPI


class BackgroundServer:
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning"):
        self.app = app
        self.host = host
        # Bind here so the port is ours before the thread starts (no pick-then-bind race).
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port: int = self._socket.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False))
        self._thread = threading.Thread(target=self._run, name=f"graphserve-http-{self.port}", daemon=True)
        self.health_statuses: list[int] = []  # every /health status seen by wait_ready, in order

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self._server.run(sockets=[self._socket])

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll /health until it answers 200 (the model is loaded)."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while True:
                status = client.get("/health").status_code
                self.health_statuses.append(status)
                if status == 200:
                    return
                state = self.app.state.graphserve
                if state.startup_error is not None:
                    raise RuntimeError(f"the engine failed to start: {state.startup_error}")
                if time.monotonic() > deadline:
                    raise TimeoutError("the server did not become ready")
                time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def sse_payloads(lines: list[str]) -> list[str]:
    """The `data:` payloads of an SSE body given as lines (e.g. httpx `iter_lines()`)."""
    return [line[len("data:") :].strip() for line in lines if line.startswith("data:")]
