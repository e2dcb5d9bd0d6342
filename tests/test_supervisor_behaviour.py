"""`graphserve serve`'s supervisor (server/supervisor.py) as a user meets it, against real
processes on loopback (CPU, the embedded model):

- how many front ends it starts when --api-server-count is not given (per machine: the one
  thing here checked in this process, since a test cannot change the machine it runs on);
- an engine that cannot start: exit status 1, the cause on the last line, no process left;
- a front end that dies: the server stops with status 1, the other front end first finishes
  the request it is running, no process left;
- the engine core that dies: the server stops with status 1 and its log names the core, even
  when a front end hangs;
- the port: a second server on a port in use fails and the first goes on serving; Ctrl-C
  (SIGINT) stops a server with status 0, and a new one takes the port at once;
- the ready line reaches a pipe at once, without PYTHONUNBUFFERED;
- an idle supervisor sleeps (it does not spin a core while it watches its children).

Every wait is bounded in time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")

from graphserve import AsyncEngine, EngineConfig
from graphserve.server import supervisor
from graphserve.server.app import create_app
from live_server import BackgroundServer, ServerProcess, child_pids, descendant_pids, socket_inodes, still_running, tcp_sockets

SERVER_ARGS = ["--device", "cpu", "--max-model-len", "256", "--kv-cache-bytes", "32MiB", "--max-num-seqs", "4",
               "--decode-chunk", "4"]
HUNG_FRONT_END_EXIT_S = 30.0  # the supervisor gives the front ends 10 s after the core died, then 10 s after SIGTERM
NO_ORPHANS_S = 10.0


# ---- the processes of a server ---------------------------------------------------------------


class Server:
    """A `python -m graphserve serve` (optionally on a given port) and every process it started,
    recorded while they run so that they can be checked after it exited."""

    def __init__(self, args: list[str], port: int | None = None, env: dict[str, str] | None = None):
        self.process = ServerProcess([*SERVER_ARGS, *args, *(["--port", str(port)] if port else [])],
                                     env={"OMP_NUM_THREADS": "1", **(env or {})})  # steady on a small shared machine
        if port is not None:
            self.process.port = port  # the last --port wins
        self.seen: dict[int, int] = {}

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def port(self) -> int:
        return self.process.port

    @property
    def log(self) -> str:
        return self.process.log

    def snapshot(self) -> None:
        self.seen.update(descendant_pids(self.process.process.pid))

    def wait_ready(self) -> None:
        self.process.wait_ready(timeout=120.0)
        self.snapshot()

    def frontends(self) -> list[int]:
        """The supervisor's children that hold a socket listening on its port."""
        listening = {inode for local, _, state, inode in tcp_sockets() if local == self.port and state == "0A"}
        return sorted(pid for pid in child_pids(self.process.process.pid) if socket_inodes(pid) & listening)

    def core(self) -> int:
        others = [pid for pid in child_pids(self.process.process.pid) if pid not in self.frontends()
                  and "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(others) == 1, (others, self.log[-3000:])
        return others[0]

    def wait_exit(self, timeout: float) -> int:
        """The exit status, recording the children until then; fails if it still runs after `timeout` s."""
        deadline = time.monotonic() + timeout
        while self.process.process.poll() is None:
            self.snapshot()
            if time.monotonic() > deadline:
                pytest.fail(f"the server still runs after {timeout:.0f} s:\n{self.log[-3000:]}")
            time.sleep(0.05)
        return self.process.wait(5)

    def assert_no_orphans(self) -> None:
        deadline = time.monotonic() + NO_ORPHANS_S
        while left := still_running(self.seen):
            if time.monotonic() > deadline:
                pytest.fail(f"processes of the server still run {NO_ORPHANS_S:.0f} s after it exited: {left}\n"
                            f"{self.log[-3000:]}")
            time.sleep(0.05)

    def lines(self) -> list[str]:
        return [line for line in self.log.splitlines() if line.strip()]

    def stop(self) -> None:
        self.process.stop()  # SIGKILL if it still runs: its children die with it


def accepted_by(server: Server, client: socket.socket, frontends: list[int], timeout: float = 10.0) -> int:
    """The front end that holds the server's end of the connection `client` made."""
    client_port = client.getsockname()[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ends = {inode for local, remote, _, inode in tcp_sockets() if local == server.port and remote == client_port}
        owners = [pid for pid in frontends if socket_inodes(pid) & ends]
        if owners:
            return owners[0]
        time.sleep(0.02)
    raise AssertionError(f"no front end accepted the connection from port {client_port}")


def send_request(sock: socket.socket, method: str, path: str, body: dict | None = None) -> None:
    """One HTTP/1.1 request on an open connection, Connection: close (the server closes it)."""
    payload = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {len(payload)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    sock.sendall(head.encode() + b"\r\n" + payload)


def read_response(sock: socket.socket, timeout: float = 60.0) -> tuple[int | None, bytes]:
    """Status (None if the connection ended without an answer) and body, read until the server closes."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    header, _, content = received.partition(b"\r\n\r\n")
    if not header.startswith(b"HTTP/1.1 "):
        return None, received
    return int(header.split(b" ", 2)[1]), content


def running_requests(url: str) -> float:
    with httpx.Client(base_url=url, timeout=30.0) as http:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("graphserve_num_requests_running "):
                return float(line.split()[1])
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User and system time the process has used so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- how many front ends -----------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "driver", "cores", "expected"), [
    ([], False, 64, 1),  # the default config (device auto) without the NVIDIA driver: the CPU engine, one
    (["--device", "cpu"], True, 64, 1),  # --device cpu on a GPU machine: still one
    ([], True, 2, 1),  # on a GPU machine: a front end per 3 cores beyond 2, at least 1 ...
    ([], True, 5, 1),
    ([], True, 7, 1),
    ([], True, 8, 2),
    ([], True, 10, 2),
    ([], True, 11, 3),
    ([], True, 13, 3),
    ([], True, 14, 4),
    ([], True, 64, 4),  # ... at most 4
    (["--device", "cuda"], False, 11, 3),  # --device cuda counts as a GPU machine
    (["--device", "cuda:1"], True, 2, 1),
    (["--device", "cuda"], True, 8, 2),
    (["--api-server-count", "3"], False, 2, 3),  # the flag always wins
    (["--api-server-count", "1"], True, 64, 1),
])
def test_the_default_number_of_front_ends_follows_the_machine(
    flags: list[str], driver: bool, cores: int, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`graphserve serve` without --api-server-count: one front end on CPU; on a GPU machine (the
    NVIDIA driver is there, or --device cuda) one per 3 cores beyond the 2 it leaves to the core,
    at least 1 and at most 4. The machine is faked (its cores, the driver's presence): a test
    cannot change the machine it runs on."""
    from graphserve.server.cli import build_parser, load_settings

    exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self: driver if str(self) == "/proc/driver/nvidia" else exists(self))
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    server, engine, _ = load_settings(build_parser().parse_args(["serve", *flags]))
    count = supervisor.frontend_count(server, engine)
    assert count == expected and type(count) is int, count


# ---- start-up failure -------------------------------------------------------------------------


def test_an_engine_that_cannot_start_ends_the_server_with_status_1_and_its_cause_last(tmp_path: Path) -> None:
    """A model folder without weights passes the checks made before any process starts; the
    engine core fails while it loads. With two front ends waiting for it: exit status 1, the last
    line names the cause (not a front end's echo of the core's exit, not a traceback), the server
    never said it was ready, and none of its processes is left."""
    from graphserve.engine.model_files.default_model import default_model_path

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((default_model_path() / name).read_bytes())
    server = Server(["--model", str(model), "--api-server-count", "2"])
    try:
        code = server.wait_exit(120)
    finally:
        server.stop()
    lines = server.lines()
    assert code == 1, lines[-10:]
    assert lines[-1].startswith(f"graphserve: the engine could not start: {model} has no safetensors weights"), \
        lines[-10:]
    assert not any(line.startswith("Traceback") for line in lines), server.log[-3000:]
    assert not any("graphserve ready" in line for line in lines)
    server.assert_no_orphans()


# ---- a child that dies --------------------------------------------------------------------------


def test_a_front_end_that_dies_stops_the_server_with_status_1_once_the_other_finished_its_request(
    tmp_path: Path,
) -> None:
    """kill -9 of one of two front ends: the server stops with status 1; the other front end is
    stopped as on SIGTERM, so the request it is running still gets its whole answer first (within
    the 10 s the supervisor gives a front end to exit). The folders the server made in TMPDIR (the
    core's socket, the metrics the front ends share) go with it."""
    new_tokens = 16
    server = Server(["--api-server-count", "2"], env={"TMPDIR": str(tmp_path)})
    try:
        server.wait_ready()
        assert len(list(tmp_path.glob("graphserve-*"))) == 2, list(tmp_path.iterdir())  # the core's socket too
        with httpx.Client(base_url=server.url, timeout=60.0) as http:  # the first forward passes are slow
            assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
        frontends = server.frontends()
        assert len(frontends) == 2, (frontends, server.seen)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10.0) as sock:
            serving = accepted_by(server, sock, frontends)
            victim = next(pid for pid in frontends if pid != serving)
            send_request(sock, "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": new_tokens,
                                                           "temperature": 0, "ignore_eos": True})
            deadline = time.monotonic() + 30
            while running_requests(server.url) < 1:
                assert time.monotonic() < deadline, "the request never ran"
                time.sleep(0.02)
            server.snapshot()
            os.kill(victim, signal.SIGKILL)
            status, body = read_response(sock)
        code = server.wait_exit(30)
    finally:
        server.stop()
    assert code == 1, server.log[-3000:]
    assert status == 200, (status, body[-500:], server.log[-3000:])
    answer = json.loads(body)
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == new_tokens
    assert not any(line.startswith("Traceback") for line in server.lines()), server.log[-3000:]
    server.assert_no_orphans()
    assert not list(tmp_path.glob("graphserve-*")), list(tmp_path.iterdir())




def test_the_metrics_folder_removed_under_a_running_server_does_not_spoil_its_stop(tmp_path: Path) -> None:
    """A tmp cleaner (systemd-tmpfiles) may remove the front ends' metrics folder under a server that
    runs for weeks: Ctrl-C still stops it with status 0 and no traceback."""
    server = Server(["--api-server-count", "2"], env={"TMPDIR": str(tmp_path)})
    try:
        server.wait_ready()
        (folder,) = tmp_path.glob("graphserve-metrics-*")
        shutil.rmtree(folder)
        server.process.process.send_signal(signal.SIGINT)
        code = server.wait_exit(60)
    finally:
        server.stop()
    assert code == 0, server.log[-3000:]
    assert not any(line.startswith("Traceback") for line in server.lines()), server.log[-3000:]
    server.assert_no_orphans()

def test_an_engine_in_this_process_leaves_nothing_in_the_temp_folder(tmp_path: Path, monkeypatch) -> None:
    """graphserve as a library (AsyncEngine, its core in a thread of this process): once it has
    stopped, the folder of its core's socket is gone from TMPDIR."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    engine = AsyncEngine(EngineConfig(model=None, device="cpu", max_num_seqs=2, kv_cache_bytes=16 * 1024**2))
    with BackgroundServer(create_app(engine)) as background:
        background.wait_ready()
        assert list(tmp_path.glob("graphserve-*")), list(tmp_path.iterdir())
        assert httpx.post(background.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                          timeout=60).status_code == 200
    assert not list(tmp_path.glob("graphserve-*")), list(tmp_path.iterdir())

def test_the_engine_core_dying_stops_the_server_with_status_1_even_when_a_front_end_hangs() -> None:
    """kill -9 of the engine core while its front end is stuck (SIGSTOP: it can neither fail its
    requests nor exit): the server still stops, with status 1, its log names the core's exit,
    and none of its processes is left. While it waits for the stuck front end, the supervisor
    sleeps."""
    server = Server(["--api-server-count", "1"])
    try:
        server.wait_ready()
        (frontend,) = server.frontends()
        core = server.core()
        supervisor_pid = server.process.process.pid
        os.kill(frontend, signal.SIGSTOP)
        os.kill(core, signal.SIGKILL)
        killed_at, cpu_before = time.monotonic(), cpu_seconds(supervisor_pid)
        time.sleep(5.0)  # within the 10 s it gives the front ends after the core died
        waiting = time.monotonic() - killed_at
        used = cpu_seconds(supervisor_pid) - cpu_before
        code = server.wait_exit(HUNG_FRONT_END_EXIT_S + 10)
        took = time.monotonic() - killed_at
    finally:
        server.stop()
    assert code == 1, server.log[-3000:]
    assert took < HUNG_FRONT_END_EXIT_S, took
    assert used < 0.1 * waiting, f"the supervisor used {used:.2f} s of CPU in {waiting:.1f} s while it waited"
    assert any(f"the engine core exited with status {-signal.SIGKILL}" in line for line in server.lines()), \
        server.log[-3000:]
    assert "Traceback" not in server.log, server.log[-3000:]  # a core that died after ready: no start failure
    server.assert_no_orphans()


# ---- the port, Ctrl-C, an idle supervisor ---------------------------------------------------------


@pytest.fixture(scope="module")
def first() -> Iterator[Server]:
    """A server with one front end, ready (the tests below stop it). Its output is a pipe and
    PYTHONUNBUFFERED is not set, as under systemd or docker: the ready line still comes at once."""
    server = Server(["--api-server-count", "1"], env={"PYTHONUNBUFFERED": ""})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    server.assert_no_orphans()


def test_an_idle_supervisor_sleeps(first: Server) -> None:
    pid = first.process.process.pid
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(3.0)
    used, took = cpu_seconds(pid) - before, time.monotonic() - started
    assert used < 0.1 * took, f"the idle supervisor used {used:.2f} s of CPU in {took:.1f} s"


def test_a_second_server_on_a_port_in_use_fails_and_the_first_goes_on(first: Server) -> None:
    """One front end listens alone on its port: a second server started on it (one front end
    too) exits non-zero naming the cause, and every connection still reaches the first."""
    second = Server(["--api-server-count", "1"], port=first.port)
    try:
        code = second.wait_exit(60)
    finally:
        second.stop()
    assert code != 0, second.log[-3000:]
    assert "Address already in use" in second.lines()[-1], second.lines()[-5:]
    second.assert_no_orphans()
    for _ in range(4):
        with httpx.Client(base_url=first.url, timeout=30.0) as http:
            assert http.get("/health").status_code == 200


def test_ctrl_c_stops_the_server_with_status_0_and_a_new_one_takes_the_port_at_once(first: Server) -> None:
    """SIGINT (Ctrl-C in a terminal) stops the server cleanly: status 0, no process left. Its
    port is free at once, though the connections it closed are still in TIME_WAIT."""
    with socket.create_connection(("127.0.0.1", first.port), timeout=10.0) as sock:
        send_request(sock, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert read_response(sock)[0] == 200
    first.snapshot()
    first.process.process.send_signal(signal.SIGINT)
    assert first.wait_exit(60) == 0, first.log[-3000:]
    first.assert_no_orphans()

    again = Server(["--api-server-count", "1"], port=first.port)
    try:
        again.wait_ready()
        with httpx.Client(base_url=again.url, timeout=30.0) as http:
            assert http.get("/health").status_code == 200
        again.process.terminate()
        assert again.wait_exit(60) == 0, again.log[-3000:]
    finally:
        again.stop()
    again.assert_no_orphans()
