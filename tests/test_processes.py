"""The server as processes (issue 9): `python -m graphserve serve` is a supervisor with one
engine-core process and N front-end processes. Against real processes on loopback (CPU,
the embedded model):

- greedy outputs are the same in-process (the offline `LLM`, and a server whose core runs in a
  thread) and through the core process with 1 and 2 front ends; seeded sampling too;
- with 2 front ends the connections are spread over both, whether they arrive one after
  another or in a burst, and /metrics on either adds both up;
- life cycle: kill -9 of the core mid-stream (error events, 5xx, /health 503, non-zero exit),
  of the supervisor and of a front end; SIGTERM during streams; no process of a server is
  left after any test;
- a stop string found in the front end ends the core's request: trimmed text, blocks freed
  long before max_tokens, usage counts up to the token that completed the stop.

Every wait is bounded in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve.engine.async_engine import AsyncEngine
from graphserve.engine.config import EngineConfig
from graphserve.engine.llm import LLM
from graphserve.engine.request import SamplingParams
from graphserve.server.app import create_app
from live_server import (BackgroundServer, ServerProcess, child_pids, descendant_pids, socket_inodes, sse_payloads,
                                       still_running, tcp_sockets)

DECODE_CHUNK = 8  # K: tokens per decode round
MAX_MODEL_LEN = 512
KV_CACHE_MIB = 64
ENGINE = dict(device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_MIB * 2**20, max_num_seqs=8,
              decode_chunk=DECODE_CHUNK)
SERVER_ARGS = ["--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes", f"{KV_CACHE_MIB}MiB",
               "--max-num-seqs", "8", "--decode-chunk", str(DECODE_CHUNK)]

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def add(a, b):",
    "Water boils at",
    "The quick brown fox",
    "My favourite colour is",
    "1, 2, 3, 4,",
    "The largest planet is",
]
NEW_TOKENS = 16
SEEDS = [7, 1234, 2**40 + 3, 99]  # one per seeded prompt (PROMPTS[:4])
EXIT_AFTER_CORE_DEATH_S = 15.0  # "within a few seconds": the supervisor's own grace is 10 s
NO_ORPHANS_S = 10.0


# ---- the processes of a server ---------------------------------------------------------------


class Served:
    """A ServerProcess and every process it started (recorded while they run, so they can be
    checked after the server is gone)."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.seen: dict[int, int] = {}  # pid -> start time

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int:
        return self.server.process.pid

    def snapshot(self) -> dict[int, int]:
        self.seen.update(descendant_pids(self.pid))
        return self.seen

    def frontends(self) -> list[int]:
        """The supervisor's children that hold the listening socket."""
        listening = {inode for local, _, state, inode in tcp_sockets() if local == self.server.port and state == "0A"}
        assert listening, f"nothing listens on port {self.server.port}"
        return sorted(pid for pid in child_pids(self.pid) if socket_inodes(pid) & listening)

    def core(self) -> int:
        """The supervisor's one child that is neither a front end nor multiprocessing's resource tracker."""
        others = [pid for pid in child_pids(self.pid) if pid not in self.frontends()
                  and "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(others) == 1, (others, self.server.log)
        return others[0]

    def assert_no_orphans(self, timeout: float = NO_ORPHANS_S) -> float:
        """Every process the server started is gone within `timeout` s; returns how long it took."""
        start = time.monotonic()
        while left := still_running(self.seen):
            if time.monotonic() - start > timeout:
                described = {pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120] for pid in left}
                pytest.fail(f"processes of the server still run {timeout:.0f} s after it exited: {described}\n"
                            f"{self.server.log[-3000:]}")
            time.sleep(0.05)
        return time.monotonic() - start


@contextmanager
def serving(frontends: int) -> Iterator[Served]:
    """A server with `frontends` front ends, ready; afterwards (killed if it still runs) none
    of its processes is left."""
    server = ServerProcess([*SERVER_ARGS, "--api-server-count", str(frontends)])
    served = Served(server)
    try:
        server.wait_ready()
        served.snapshot()
        assert len(served.frontends()) == frontends, served.seen
        served.core()
        yield served
    finally:
        server.stop()  # SIGKILL if it still runs: its children die with it (PDEATHSIG)
    served.assert_no_orphans()


def stop_gracefully(served: Served) -> None:
    """SIGTERM, exit 0, nothing left."""
    served.snapshot()
    served.server.terminate()
    code = served.server.wait(60)
    assert code == 0, served.server.log[-3000:]
    served.assert_no_orphans()


def accepted_by(served: Served, client: socket.socket, frontends: list[int], timeout: float = 10.0) -> int:
    """The front end that accepted the connection `client` made (the server's end of it is one
    of that process's file descriptors)."""
    client_port = client.getsockname()[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ends = {inode for local, remote, _, inode in tcp_sockets()
                if local == served.server.port and remote == client_port}
        owners = [pid for pid in frontends if socket_inodes(pid) & ends]
        if owners:
            assert len(owners) == 1, owners
            return owners[0]
        time.sleep(0.02)
    raise AssertionError(f"no front end accepted the connection from port {client_port}")


def send_request(sock: socket.socket, method: str, path: str, body: dict[str, Any] | None = None) -> None:
    """One HTTP/1.1 request on an open connection (Connection: close)."""
    payload = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {len(payload)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    sock.sendall(head.encode() + b"\r\n" + payload)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and body of the answer to `send_request`, read until the server closes."""
    sock.settimeout(60.0)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    header, _, content = received.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" not in header.lower(), header
    return int(header.split(b" ", 2)[1]), content


# ---- metrics ------------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metrics(url: str) -> dict[str, float]:
    with httpx.Client(base_url=url, timeout=30.0) as http:  # a new connection: either front end may answer
        return parse_metrics(http.get("/metrics").text)


def requests_total(values: dict[str, float]) -> float:
    return sum(v for k, v in values.items() if k.startswith("graphserve_requests_total{"))


def wait_until_idle(url: str, timeout: float) -> dict[str, float]:
    """Until nothing runs or waits in the core and every KV block is free (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url)
        idle = values["graphserve_num_requests_running"] == values["graphserve_num_requests_waiting"] == 0
        if idle and values["graphserve_kv_blocks_free"] == values["graphserve_kv_blocks_total"]:
            return values
        if time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def wait_for_running(url: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metrics(url).get("graphserve_num_requests_running", 0) < count:
        assert time.monotonic() < deadline, f"{count} requests never ran at once: {metrics(url)}"
        time.sleep(0.05)


# ---- servers shared by the tests that do not stop them -------------------------------------------


@pytest.fixture(scope="module")
def one_frontend() -> Iterator[Served]:
    with serving(1) as served:
        yield served
        stop_gracefully(served)


@pytest.fixture(scope="module")
def two_frontends() -> Iterator[Served]:
    with serving(2) as served:
        yield served
        stop_gracefully(served)


@pytest.fixture(scope="module")
def in_process() -> Iterator[BackgroundServer]:
    """A server whose core runs in a thread of this process."""
    with BackgroundServer(create_app(AsyncEngine(EngineConfig(**ENGINE)))) as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="module")
def reference() -> dict[str, list[str]]:
    """The offline engine in this process: greedy and seeded texts, all prompts in one batch."""
    llm = LLM(**ENGINE)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    seeded = llm.generate(PROMPTS[: len(SEEDS)],
                          [SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=seed) for seed in SEEDS])
    del llm
    return {"greedy": [o.text for o in greedy], "seeded": [o.text for o in seeded]}


async def served_texts(url: str) -> tuple[list[str], list[str]]:
    """The greedy prompts (not streamed) and the seeded ones (streamed), all at once through
    the official client."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120.0) as client:
        model = (await client.models.list()).data[0].id

        async def greedy(prompt: str, delay: float) -> str:
            await asyncio.sleep(delay)  # connections opened one after another: spread over the front ends
            completion = await client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                         temperature=0)
            return completion.choices[0].text

        async def seeded(prompt: str, seed: int, delay: float) -> str:
            await asyncio.sleep(delay)
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                     temperature=1.0, seed=seed, stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        results = await asyncio.wait_for(asyncio.gather(
            *(greedy(p, 0.02 * i) for i, p in enumerate(PROMPTS)),
            *(seeded(p, s, 0.01 + 0.02 * i) for i, (p, s) in enumerate(zip(PROMPTS, SEEDS, strict=False)))), 240)
    return list(results[: len(PROMPTS)]), list(results[len(PROMPTS) :])


# ---- 1. the same outputs wherever the core runs ---------------------------------------------------


@pytest.mark.parametrize("where", ["in_process", "one_frontend", "two_frontends"])
def test_outputs_are_the_same_in_process_and_through_the_core_process(
    where: str, reference: dict[str, list[str]], request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue(where)
    greedy, seeded = asyncio.run(served_texts(server.url))
    assert all(reference["greedy"]) and len(set(reference["greedy"])) > 1, reference
    assert greedy == reference["greedy"]
    assert seeded == reference["seeded"], "the same seed gives the same sample"
    assert seeded != reference["greedy"][: len(SEEDS)], "the seeded runs really sampled"


# ---- 2. two front ends --------------------------------------------------------------------------


def test_two_frontends_share_the_connections_and_add_up_their_metrics(two_frontends: Served) -> None:
    served = two_frontends
    frontends = served.frontends()
    assert len(frontends) == 2
    before = requests_total(wait_until_idle(served.url, 30.0))

    connections = []
    try:
        for _ in range(24):  # clients arriving one after another (a burst: the next test)
            connections.append(socket.create_connection(("127.0.0.1", served.server.port), timeout=10.0))
            time.sleep(0.01)
        owners = [accepted_by(served, sock, frontends) for sock in connections]
        for sock in connections:  # all sent before any is read: none waits long for its headers
            send_request(sock, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        statuses = [read_response(sock)[0] for sock in connections]
    finally:
        for sock in connections:
            sock.close()
    assert statuses == [200] * len(connections)
    served_by = Counter(owners)
    assert set(served_by) == set(frontends), f"one front end took every connection: {served_by}"

    # a scrape on each front end (known by the connection it answers): both count every request
    scrapes = [socket.create_connection(("127.0.0.1", served.server.port), timeout=10.0) for _ in range(8)]
    try:
        scraped_by = [accepted_by(served, sock, frontends) for sock in scrapes]
        for sock in scrapes:
            send_request(sock, "GET", "/metrics")
        answers = [read_response(sock) for sock in scrapes]
        assert [status for status, _ in answers] == [200] * len(scrapes)
        totals = [requests_total(parse_metrics(content.decode())) for _, content in answers]
    finally:
        for sock in scrapes:
            sock.close()
    assert totals == [before + len(connections)] * len(scrapes), list(zip(scraped_by, totals, strict=True))
    if len(set(scraped_by)) < 2:  # unlikely (1 in 128): the other front end's view through a few more
        for _ in range(20):
            assert requests_total(metrics(served.url)) == before + len(connections)


def test_a_burst_of_connections_is_spread_over_both_frontends(two_frontends: Served) -> None:
    """Connections that arrive together (a load balancer's or a benchmark's clients opening
    their keep-alive connections at once) must not all land on one front end: that one would
    then serve them for as long as they live. Each of 4 bursts of 64: at least 1/4 on each."""
    served = two_frontends
    frontends = served.frontends()
    splits = []
    for _ in range(4):
        burst = []
        try:
            for _ in range(64):
                burst.append(socket.create_connection(("127.0.0.1", served.server.port), timeout=10.0))
            splits.append(Counter(accepted_by(served, sock, frontends) for sock in burst))
        finally:
            for sock in burst:
                sock.close()
        time.sleep(0.2)
    shares = [min(split[pid] for pid in frontends) for split in splits]
    assert min(shares) >= 16, f"connections per front end in each burst of 64: {[dict(s) for s in splits]}"


# ---- 3. life cycle --------------------------------------------------------------------------------


def stream_until_end(url: str, body: dict[str, Any], started: threading.Event, into: dict[str, Any]) -> None:
    """A streamed request read to its end (or until the connection breaks): status, payloads."""
    payloads: list[str] = []
    into["payloads"] = payloads
    try:
        with httpx.Client(base_url=url, timeout=60.0) as http, \
                http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            into["status"] = response.status_code
            for line in response.iter_lines():
                payloads.extend(sse_payloads([line]))
                if payloads and payloads[0] != "[DONE]":
                    started.set()
    except httpx.HTTPError as exc:
        into["error"] = repr(exc)
    finally:
        started.set()


def post_until_answer(url: str, body: dict[str, Any], into: dict[str, Any]) -> None:
    try:
        with httpx.Client(base_url=url, timeout=60.0) as http:
            response = http.post("/v1/completions", json=body)
        into["status"], into["body"], into["type"] = response.status_code, response.text, response.headers.get(
            "content-type", "")
    except httpx.HTTPError as exc:
        into["error"] = repr(exc)


def test_kill_9_of_the_core_mid_stream_fails_the_requests_and_the_server() -> None:
    long = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
    with serving(2) as served:
        core = served.core()
        streams = [{}, {}]
        started = [threading.Event(), threading.Event()]
        unary: dict[str, Any] = {}
        threads = [threading.Thread(target=stream_until_end, args=(served.url, {"prompt": PROMPTS[i], **long},
                                                                  started[i], streams[i]), daemon=True)
                   for i in range(2)]
        threads.append(threading.Thread(target=post_until_answer, args=(served.url, {"prompt": PROMPTS[2], **long},
                                                                        unary), daemon=True))
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(60), "no stream started"
        wait_for_running(served.url, 3)
        served.snapshot()

        os.kill(core, signal.SIGKILL)
        killed_at = time.monotonic()
        health: list[int | str] = []
        while served.server.process.poll() is None and time.monotonic() - killed_at < 5.0:
            try:  # a new connection each time: either front end may answer
                health.append(httpx.get(served.url + "/health", timeout=0.5).status_code)
            except httpx.HTTPError as exc:
                health.append(type(exc).__name__)
            time.sleep(0.02)
        try:
            code = served.server.wait(EXIT_AFTER_CORE_DEATH_S)
        except Exception:
            pytest.fail(f"the server still ran {EXIT_AFTER_CORE_DEATH_S:.0f} s after its core was killed:\n"
                        f"{served.server.log[-3000:]}")
        exited_after = time.monotonic() - killed_at
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "a request still waits after the server exited"

    assert code != 0 and exited_after < EXIT_AFTER_CORE_DEATH_S, (code, exited_after)
    for stream in streams:
        assert stream.get("status") == 200 and "error" not in stream, stream
        payloads = stream["payloads"]
        assert payloads[-1] == "[DONE]", f"the stream did not end with an error event then [DONE]: {payloads[-3:]}"
        events = [json.loads(p) for p in payloads[:-1]]
        assert "error" in events[-1] and events[-1]["error"]["message"], events[-1]
        assert not any("error" in e for e in events[:-1])
        assert not any(c.get("finish_reason") for e in events[:-1] for c in e.get("choices", [])), \
            "a stream cut by the core's death does not claim a normal end"
        assert len(events) >= 2, "the stream had content before the kill"
    assert "error" not in unary, unary
    assert unary["status"] >= 500 and unary["type"].startswith("application/json"), unary
    error = json.loads(unary["body"])["error"]
    assert error["message"] and {"message", "type", "code"} <= set(error), error
    assert 503 in health, f"/health never answered 503 after the core died: {health}"
    assert 200 not in health[health.index(503):], health


def test_kill_9_of_the_supervisor_leaves_no_process() -> None:
    with serving(2) as served:
        served.snapshot()
        assert len(served.seen) >= 3, served.seen  # core and two front ends (and the resource tracker)
        served.server.process.send_signal(signal.SIGKILL)
        served.server.wait(10)
        took = served.assert_no_orphans()
    assert took < NO_ORPHANS_S


def test_kill_9_of_a_front_end_stops_the_server() -> None:
    with serving(2) as served:
        victim, other = served.frontends()
        core = served.core()
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        code = served.server.wait(30)
        exited_after = time.monotonic() - killed_at
        assert code != 0, served.server.log[-3000:]
        assert core in served.seen and other in served.seen
        served.assert_no_orphans()  # the core and the other front end too
    assert exited_after < EXIT_AFTER_CORE_DEATH_S, exited_after


def test_sigterm_during_four_streams_finishes_them_and_exits_0() -> None:
    new_tokens = 24

    async def four_streams(served: Served) -> list[tuple[str, str | None, int | None]]:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120.0) as client:
            model = (await client.models.list()).data[0].id
            streams = await asyncio.gather(*(client.completions.create(
                model=model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) for prompt in PROMPTS[:4]))
            iterators = [stream.__aiter__() for stream in streams]
            firsts = await asyncio.gather(*(it.__anext__() for it in iterators))  # every stream is running
            served.snapshot()
            served.server.terminate()

            async def rest(first: Any, iterator: Any) -> tuple[str, str | None, int | None]:
                chunks = [first] + [chunk async for chunk in iterator]
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                usage = [c.usage.completion_tokens for c in chunks if c.usage]
                return text, reasons[-1] if reasons else None, usage[-1] if usage else None

            return await asyncio.wait_for(asyncio.gather(*map(rest, firsts, iterators)), 120)

    with serving(2) as served:
        results = asyncio.run(four_streams(served))
        code = served.server.wait(60)
        assert code == 0, served.server.log[-3000:]
    assert [(reason, usage) for _, reason, usage in results] == [("length", new_tokens)] * 4, results
    assert all(text for text, _, _ in results)


# ---- 4. stop strings found in the front end --------------------------------------------------------


def test_a_stop_string_ends_the_core_request(one_frontend: Served) -> None:
    url = one_frontend.url
    prompt = PROMPTS[4]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
    model = client.models.list().data[0].id
    # the greedy text without a stop, token by token; the special tokens (ids 0-2) banned: whether greedy
    # text reaches an <|im_end|> within 40 tokens is the Q4_1 weights' pick, which differs by CPU, and a
    # special token is left out of the text
    no_specials = {"0": -100, "1": -100, "2": -100}
    free = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0, logprobs=0,
                                     logit_bias=no_specials, extra_body={"ignore_eos": True}).choices[0]
    tokens, offsets, text = free.logprobs.tokens, free.logprobs.text_offset, free.text
    assert "".join(tokens) == text and len(tokens) == 40, (tokens, text)
    # a stop string over the boundary of tokens k-1 and k (its first occurrence): it completes at token k
    for k in range(6, 38):
        stop = text[offsets[k] - 2 : offsets[k] + 2]
        if len(tokens[k - 1]) >= 2 and len(tokens[k]) >= 2 and stop.strip() and text.find(stop) == offsets[k] - 2:
            break
    else:
        pytest.fail(f"no stop string to pick from {tokens}")

    before = wait_until_idle(url, 30.0)
    assert before["graphserve_kv_blocks_free"] == before["graphserve_kv_blocks_total"]
    started = time.monotonic()
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=400, temperature=0, stop=[stop],
                                       logit_bias=no_specials, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    answered_after = time.monotonic() - started
    after = wait_until_idle(url, 10.0)
    idle_after = time.monotonic() - started

    received = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert received == text[: offsets[k] - 2], (stop, received, text)
    assert reasons == ["stop"]
    assert len(usage) == 1 and usage[0].completion_tokens == k + 1, (k, usage, tokens)
    generated = after["graphserve_generation_tokens_total"] - before["graphserve_generation_tokens_total"]
    assert generated == k + 1, "the server's token counter counts what the client received"
    # the core's request ended at the stop, not at max_tokens: nothing runs, every block is free,
    # and the core ran a few rounds beyond the stop at most (400 tokens would take 50)
    assert after["graphserve_num_requests_running"] == after["graphserve_num_requests_waiting"] == 0, after
    assert after["graphserve_kv_blocks_free"] == after["graphserve_kv_blocks_total"], after
    rounds = after["graphserve_decode_rounds_total"] - before["graphserve_decode_rounds_total"]
    assert rounds <= (k + 1) // DECODE_CHUNK + 4, (rounds, k, answered_after, idle_after)


def test_sigusr1_prints_the_stacks_and_the_server_goes_on(one_frontend: Served) -> None:
    """The README's way to see where a stuck server is: SIGUSR1 to the core and the front end
    (`pkill -USR1 -f spawn_main`) prints each thread's stack to the log; both keep serving."""
    url, server = one_frontend.url, one_frontend.server
    core, frontend = one_frontend.core(), one_frontend.frontends()[0]
    for pid in (core, frontend):
        assert "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
    logged = len(server.lines)
    for pid in (core, frontend):
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while sum("most recent call first" in line for line in server.lines[logged:]) < 2:
        assert time.monotonic() < deadline, server.log[-3000:]
        time.sleep(0.05)
    dumped = "".join(server.lines[logged:])
    assert "engine/core/loop.py" in dumped  # the core's main thread, in its loop
    assert "uvicorn" in dumped or "asyncio" in dumped  # the front end's event loop
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
    model = client.models.list().data[0].id
    assert client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4).choices[0].text
    assert one_frontend.core() == core and one_frontend.frontends() == [frontend]


def test_time_to_first_token_splits_into_queue_prefill_and_return_time(one_frontend: Served) -> None:
    """/metrics splits each request's time to first token into its way to the prefill step that
    takes it (the hop to the engine core, waiting there), the prefill, and the first token's way
    back: the three add up to the time to first token. Ten requests on 8 sequence slots: the two
    that wait for a slot show it as queue time."""
    url = one_frontend.url
    before = wait_until_idle(url, 30.0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
    model = client.models.list().data[0].id
    latencies: list[float] = []

    def one(prompt: str) -> None:
        started = time.monotonic()
        client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
        latencies.append(time.monotonic() - started)

    threads = [threading.Thread(target=one, args=(PROMPTS[i % len(PROMPTS)],)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(latencies) == 10
    after = wait_until_idle(url, 30.0)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    parts = ["queue_time", "prefill_time", "first_token_return"]
    for part in parts:
        assert delta[f"graphserve_request_{part}_seconds_count"] == 10, part
    ttft = delta["graphserve_time_to_first_token_seconds_sum"]
    queue, prefill, back = (delta[f"graphserve_request_{part}_seconds_sum"] for part in parts)
    assert abs(queue + prefill + back - ttft) < 1e-5, (queue, prefill, back, ttft)
    assert prefill > 0 and back > 0
    # two requests waited for a slot about as long as the others' whole 40 tokens took
    assert queue > 0.8 * min(latencies), (queue, sorted(latencies))


def test_metrics_count_the_core_processes_full_garbage_collections(one_frontend: Served) -> None:
    """A full collection stops the core's loop and every request in flight with it, so /metrics
    reports the core process's (engine/gc_stats.py): at least the one freeze_startup_objects ran
    once the model was loaded."""
    values = metrics(one_frontend.url)
    assert values["graphserve_core_gc_full_collections_total"] >= 1
    assert values["graphserve_core_gc_full_collection_seconds_total"] > 0


def test_a_full_collection_after_start_up_skips_the_start_up_objects():
    """engine/child_process.freeze_startup_objects (the core, each front end and each tensor-
    parallel rank call it once started): the objects alive then are out of the garbage
    collector's sight, so a full collection no longer walks them while requests wait."""
    import gc

    from graphserve.engine.child_process import freeze_startup_objects

    startup = [[i] for i in range(300_000)]  # long-lived, as a loaded engine's objects are

    def full_collection_s() -> float:
        start = time.perf_counter()
        gc.collect()
        return time.perf_counter() - start

    before = min(full_collection_s() for _ in range(2))
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() >= len(startup)
        after = max(full_collection_s() for _ in range(2))
    finally:
        gc.unfreeze()
    assert after < before / 5, (before, after)
