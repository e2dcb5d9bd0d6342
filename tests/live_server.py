"""A real graphserve server on loopback, for tests and benchmarks, and the /proc reads that watch its processes.

In a background thread of this process (`BackgroundServer`), or as its own process (`ServerProcess`,
`python -m graphserve serve`, for signals, exit codes and load without sharing the GIL).

    with BackgroundServer(create_app(AsyncEngine(EngineConfig(device="cpu")))) as server:
        server.wait_ready()
        httpx.get(server.url + "/health")

    with ServerProcess(["--device", "cpu", "--max-model-len", "256"]) as server:
        server.wait_ready()
        server.terminate()  # SIGTERM, as `docker stop` sends
        assert server.wait() == 0
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

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
        import httpx  # a dev extra: imported here, so that importing this module needs only the runtime

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m graphserve serve --port P ARGS...` as a child process; its output is kept in
    `self.lines` (read by a thread, so a chatty server never blocks on a full pipe)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, host: str = "127.0.0.1",
                 python: str = sys.executable, cwd: Path | None = None):
        self.host = host
        self.port = free_port(host)
        command = [python, "-m", "graphserve", "serve", "--host", host, "--port", str(self.port), *args]
        self.process = subprocess.Popen(
            command,
            cwd=cwd or Path(__file__).resolve().parent.parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, name=f"graphserve-log-{self.port}", daemon=True)
        self._reader.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Until the server prints that it is ready (the model is loaded)."""
        deadline = time.monotonic() + timeout
        while not any("graphserve ready" in line for line in self.lines):
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log}")
            if time.monotonic() > deadline:
                self.dump_stacks()
                raise TimeoutError(f"the server did not become ready (its processes' stacks at the end):\n{self.log}")
            time.sleep(0.05)

    def dump_stacks(self, settle: float = 2.0) -> None:
        """SIGUSR1 to each process the server spawned (core, front ends, ranks: they print
        every thread's stack into the log and go on); waits `settle` s for the dumps."""
        for pid in descendant_pids(self.process.pid):
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGUSR1)
            except (FileNotFoundError, ProcessLookupError):
                pass
        time.sleep(settle)

    def terminate(self) -> None:
        """SIGTERM: drain, then exit."""
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        code = self.process.wait(timeout)
        self._reader.join(5.0)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(5.0)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# ---- the processes of a server (Linux /proc) ----------------------------------------------------


def process_start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot; with the pid it names one process
    even if the pid is reused), or None if there is no such process or it is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    if fields[0] in ("Z", "X"):  # exited, not yet reaped: it holds nothing but its pid
        return None
    return int(fields[19])


def tcp_sockets() -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state, inode) of every TCP socket in this network namespace."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            rows.append((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16), fields[3],
                         int(fields[9])))
    return rows


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets `pid` holds open."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, PermissionError):
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def child_pids(pid: int) -> list[int]:
    """The children of `pid` (every thread's), from /proc/PID/task/*/children."""
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for task in tasks:
        try:
            children += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return children


def descendant_pids(pid: int) -> dict[int, int]:
    """Every live descendant of `pid`: pid -> start time (see `still_running`)."""
    found: dict[int, int] = {}
    todo = child_pids(pid)
    while todo:
        child = todo.pop()
        started = process_start_time(child)
        if started is not None and child not in found:
            found[child] = started
            todo += child_pids(child)
    return found


def still_running(processes: dict[int, int]) -> list[int]:
    """The pids of `processes` (pid -> start time, as `descendant_pids` gives) that still run."""
    return [pid for pid, started in processes.items() if process_start_time(pid) == started]
