"""A hostile client's requests (issue 14): none may hurt another client or the server.

Every input is bounded before it costs anything (numeric extremes, NaN/Infinity, list caps,
prompts x n checked before tokenizing); the event loop keeps answering while maximal
requests are tokenized; connections that never finish a request are timed out and a
flood past --max-connections is refused or evicted instead of starving /health; a client
that leaves mid-upload is no 500; log lines stay bounded. One real server process
(`python -m graphserve serve`, the embedded model on CPU) with small limits serves the file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")

from graphserve.engine.errors import InvalidRequestError
from graphserve.engine.request import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_COUNT,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from graphserve.server.cli import build_parser, load_settings
from graphserve.server.connections import RateLimitFilter, raise_fd_limit
from graphserve.server.protocol import MAX_CHAT_MESSAGES, MAX_PROMPTS
from graphserve.server.request_params import SUMMARY_MAX_CHARS, for_choice, summarize_params
from graphserve.server.settings import SettingsError, merge_settings
from live_server import ServerProcess

MAX_CONNECTIONS = 50
HEADER_TIMEOUT = 0.5
BODY_TIMEOUT = 1.0
MAX_QUEUE_LEN = 16
HEALTH_BUDGET_S = 1.0
SERVER_ARGS = [
    "--device", "cpu", "--max-model-len", "256", "--kv-cache-bytes", "32MiB", "--max-num-seqs", "4",
    "--max-queue-len", str(MAX_QUEUE_LEN), "--max-connections", str(MAX_CONNECTIONS),
    "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
]
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(SERVER_ARGS) as process:
        process.wait_ready()
        yield process


def assert_error(response: httpx.Response, status: int, param: str | None = "any") -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param != "any":
        assert error["param"] == param, error
    return error


def post_raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """A body as written (JSON's NaN / Infinity literals included)."""
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def error_counts(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    found = re.findall(r'^graphserve_request_errors_total\{status="(\d+)"\} ([0-9.e+]+)$', text, re.M)
    return {status: float(value) for status, value in found}


def health_latency(url: str) -> tuple[int, float]:
    """/health over a fresh connection: (status, seconds); (0, s) when the connection failed."""
    started = time.monotonic()
    try:
        response = httpx.get(url + "/health", timeout=10.0)
    except httpx.HTTPError:
        return 0, time.monotonic() - started
    if response.status_code == 503:  # refused for the connection limit, not for the engine
        assert response.json()["error"]["code"] == "too_many_connections", response.text
    return response.status_code, time.monotonic() - started


def read_until_closed(sock: socket.socket, deadline: float) -> bytes | None:
    """Everything the server sends until it closes the connection; None if still open at `deadline`."""
    received = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


# ---- 1. numeric fields at their types' extremes ----------------------------------------------

HUGE_INTS = ["2147483648", "9223372036854775808", "-9223372036854775809", "18446744073709551616", "1" + "0" * 30]
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999"]
INT_FIELDS = ["max_tokens", "min_tokens", "top_k", "n", "logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


def test_numeric_extremes_are_400_naming_the_field(client: httpx.Client) -> None:
    """Before: top_k 2**63 was a 500 (and failed its batch mates), temperature Infinity a 200."""
    cases = [(f, v) for f in INT_FIELDS for v in HUGE_INTS] + [(f, v) for f in FLOAT_FIELDS for v in NON_FINITE]
    cases += [("seed", "9223372036854775808"), ("seed", "-9223372036854775809"), ("seed", "1" + "0" * 30),
              ("seed", "NaN"), ("top_k", "Infinity"), ("max_tokens", "1e300")]
    chat_base = f'"messages": {json.dumps(CHAT)}'
    for field, value in cases:
        for path, base in (("/v1/completions", '"prompt": "x"'), ("/v1/chat/completions", chat_base)):
            name = "top_logprobs" if field == "logprobs" and "chat" in path else field
            text = f'{{{base}, "{name}": {value}}}' if name == "max_tokens" else f'{{{base}, "max_tokens": 2, "{name}": {value}}}'
            assert_error(post_raw(client, path, text), 400, name)
    for value in NON_FINITE:
        assert_error(post_raw(client, "/v1/completions", f'{{"prompt": "x", "logit_bias": {{"5": {value}}}}}'), 400,
                     "logit_bias.5")
    assert_error(client.post("/v1/completions", json={"prompt": "x", "temperature": 101}), 400, "temperature")


def test_valid_extremes_are_served(client: httpx.Client) -> None:
    """The largest values that are valid are served (a seed near int64's ends, with n > 1, stays valid)."""
    for body in (
        {"seed": SEED_MAX, "n": 2},
        {"seed": SEED_MIN, "n": 2},
        {"top_k": MAX_TOKEN_COUNT},
        {"min_tokens": MAX_TOKEN_COUNT},
        {"temperature": 100, "seed": 1},
        {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))},
        {"stop": ["z" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS},
        {"logit_bias": {str(i): -1 for i in range(MAX_LOGIT_BIAS_ENTRIES)}},
    ):
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
        assert response.status_code == 200, (body, response.text)
    assert for_choice(SamplingParams(seed=SEED_MAX), 1).seed == SEED_MIN  # wrapped, low 32 bits as seed + 1


def test_an_attacker_beside_victims_changes_nothing(client: httpx.Client, server: ServerProcess) -> None:
    """Before: top_k 2**63 beside 4 greedy requests made the attacker and 2 victims 500."""
    victims = [{"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
               for p in ("The capital of France", "One, two,", "def f(x):", "Once upon a time")]
    solo = [client.post("/v1/completions", json=v).json()["choices"][0]["text"] for v in victims]
    attacks = ['{"prompt": "x", "max_tokens": 8, "top_k": 9223372036854775808}',
               '{"prompt": "x", "max_tokens": 8, "temperature": Infinity}',
               '{"prompt": "x", "max_tokens": 8, "min_tokens": 9223372036854775808, "n": 2}',
               '{"prompt": "x", "max_tokens": 8, "stop_token_ids": [18446744073709551616]}']
    before = error_counts(client)

    async def together() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as http:
            victim_calls = [http.post("/v1/completions", json=v) for v in victims]
            attack_calls = [http.post("/v1/completions", content=a.encode()) for a in attacks]
            results = await asyncio.gather(*victim_calls, *attack_calls)
            return list(results[: len(victims)]), list(results[len(victims):])

    victim_responses, attack_responses = asyncio.run(together())
    assert [r.json()["choices"][0]["text"] for r in victim_responses] == solo
    assert [r.status_code for r in attack_responses] == [400] * len(attacks)
    assert error_counts(client).get("500", 0) == before.get("500", 0)


def test_a_request_that_fails_inside_a_step_fails_alone() -> None:
    """What no validation catches (here: a fault injected into the newest request, so every
    batch holding it raises) fails that request alone; its batch mates are retried without
    it and return exactly their solo text, and the server stays healthy."""
    # long enough to be still running together when the attacker joins
    victims = [{"prompt": p, "max_tokens": 96, "temperature": 0, "ignore_eos": True}
               for p in ("The capital of France", "One, two,", "def f(x):")]
    attacker = {"prompt": "Once upon a time", "max_tokens": 96, "temperature": 0, "ignore_eos": True}
    env = {"GRAPHSERVE_ENABLE_FAULT_INJECTION": "1"}
    with ServerProcess(SERVER_ARGS, env=env) as faulty:
        faulty.wait_ready()
        with httpx.Client(base_url=faulty.url, timeout=120.0) as http:
            solo = [http.post("/v1/completions", json=v).json()["choices"][0]["text"] for v in victims]

        async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(base_url=faulty.url, timeout=120.0) as http:
                async def running(n: int) -> None:
                    deadline = time.monotonic() + 30
                    while "graphserve_num_requests_running " + f"{n}.0" not in (await http.get("/metrics")).text:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.02)

                victim_calls = [asyncio.ensure_future(http.post("/v1/completions", json=v)) for v in victims]
                await running(len(victims))
                attack = asyncio.ensure_future(http.post("/v1/completions", json=attacker))
                await running(len(victims) + 1)
                injected = await http.post("/debug/fault", json={"kind": "request"})
                assert injected.status_code == 200
                return list(await asyncio.gather(*victim_calls)), await attack

        victim_responses, attack_response = asyncio.run(scenario())
        assert [r.json()["choices"][0]["text"] for r in victim_responses] == solo
        assert assert_error(attack_response, 500)["code"] == "internal_error"
        assert httpx.get(faulty.url + "/health", timeout=5.0).status_code == 200


# ---- 1. list fields past their caps --------------------------------------------------------------


def test_lists_past_their_caps_are_400_naming_the_cap(client: httpx.Client) -> None:
    completions = [
        ({"prompt": ["a"] * (10 * MAX_PROMPTS)}, "prompt", MAX_PROMPTS),
        ({"prompt": [[5]] * (MAX_PROMPTS + 1)}, "prompt", MAX_PROMPTS),
        ({"stop": ["x"] * (10 * MAX_STOP_STRINGS)}, "stop", MAX_STOP_STRINGS),
        ({"stop": ["x" * (10 * MAX_STOP_STRING_CHARS)]}, "stop", MAX_STOP_STRING_CHARS),
        ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", MAX_STOP_STRING_CHARS),
        ({"stop_token_ids": [1] * (10 * MAX_STOP_TOKEN_IDS)}, "stop_token_ids", MAX_STOP_TOKEN_IDS),
        ({"logit_bias": {str(i): 1 for i in range(10 * MAX_LOGIT_BIAS_ENTRIES)}}, "logit_bias", MAX_LOGIT_BIAS_ENTRIES),
    ]
    for body, param, cap in completions:
        error = assert_error(client.post("/v1/completions", json={"prompt": "x", **body}), 400, param)
        assert str(cap) in error["message"], error
    too_many = [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)
    error = assert_error(client.post("/v1/chat/completions", json={"messages": too_many}), 400, "messages")
    assert str(MAX_CHAT_MESSAGES) in error["message"]
    assert_error(client.post("/tokenize", json={"messages": too_many}), 400, "messages")


def test_sampling_params_check_the_same_bounds() -> None:
    """The engine's own check (SamplingParams.validate, the offline API's edge) rejects what the protocol rejects."""
    bad = [
        ({"top_k": 2**63}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 2**63}, "min_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1000.0}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {2**70: 1.0}}, "logit_bias"),
        ({"logprobs": 2**40}, "logprobs"),
    ]
    for kwargs, param in bad:
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(**kwargs).validate()
        assert caught.value.param == param, kwargs
    SamplingParams(top_k=MAX_TOKEN_COUNT, seed=SEED_MIN, temperature=100.0, stop=["x"] * MAX_STOP_STRINGS).validate()


# ---- 2. work before admission; the event loop stays free -----------------------------------------


def test_prompts_times_n_is_checked_before_tokenizing(client: httpx.Client) -> None:
    """Before: 8,000 prompts x n 128 took 10-24 s to be rejected, the event loop blocked."""
    for prompts in (["a"] * 8000, ["a"] * MAX_PROMPTS):
        started = time.monotonic()
        response = client.post("/v1/completions", json={"prompt": prompts, "n": 128, "max_tokens": 1})
        elapsed = time.monotonic() - started
        assert_error(response, 400)
        assert elapsed < 0.5, elapsed


def test_health_answers_while_maximal_requests_are_tokenized(server: ServerProcess) -> None:
    """Four bodies near the 1 MiB limit, each MAX_QUEUE_LEN prompts of ~60 KiB text:
    tokenized off the event loop, so /health keeps answering (before: blocked ~0.5 s per
    request, one after the other). The prompts are too long for the context: 400, never 5xx."""
    text = "The quick brown fox jumps over the lazy dog. " * 1400  # ~63 KB, ~14k tokens
    body = json.dumps({"prompt": [text] * MAX_QUEUE_LEN, "max_tokens": 1}).encode()
    assert 900 * 1024 < len(body) < 1024**2
    latencies: list[float] = []
    statuses: list[int] = []
    done = threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=server.url, timeout=10.0) as http:
            while not done.is_set():
                started = time.monotonic()
                http.get("/health")
                latencies.append(time.monotonic() - started)
                time.sleep(0.02)

    async def heavy() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0) as http:
            calls = [http.post("/v1/completions", content=body) for _ in range(4)]
            return [r.status_code for r in await asyncio.gather(*calls)]

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        statuses = asyncio.run(heavy())
    finally:
        done.set()
        poller.join()
    assert statuses == [400] * 4
    assert latencies and max(latencies) < HEALTH_BUDGET_S, max(latencies)


# ---- 4. connections ------------------------------------------------------------------------------


def test_half_open_connections_get_408_after_the_header_timeout(server: ServerProcess) -> None:
    """Before: half-open connections were held for ever (3,000 still open after 60 s)."""
    socks = []
    for i in range(MAX_CONNECTIONS - 10):
        sock = socket.create_connection((server.host, server.port))
        if i % 2:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")  # never finished
        socks.append(sock)
    started = time.monotonic()
    try:
        answers = [read_until_closed(s, started + HEADER_TIMEOUT + 3.0) for s in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(a is not None and a.startswith(b"HTTP/1.1 408") for a in answers), answers[:3]
    assert time.monotonic() - started > HEADER_TIMEOUT * 0.8
    assert health_latency(server.url)[0] == 200


def test_a_slow_body_is_timed_out(server: ServerProcess, client: httpx.Client) -> None:
    before = error_counts(client)
    sock = socket.create_connection((server.host, server.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
        started = time.monotonic()
        while time.monotonic() - started < BODY_TIMEOUT * 0.6:  # a drip that never completes
            sock.sendall(b"a")
            time.sleep(0.1)
        answer = read_until_closed(sock, started + BODY_TIMEOUT + 3.0)
    finally:
        sock.close()
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started > BODY_TIMEOUT * 0.8
    assert error_counts(client).get("500", 0) == before.get("500", 0)


def test_a_flood_of_idle_connections_cannot_lock_out_health(server: ServerProcess) -> None:
    """Past --max-connections a new connection evicts the oldest idle one (a 503 to it):
    the server never holds more, and /health from a fresh connection answers at once."""
    flood = [socket.create_connection((server.host, server.port)) for _ in range(4 * MAX_CONNECTIONS)]
    try:
        status, latency = health_latency(server.url)
        assert status == 200 and latency < HEALTH_BUDGET_S, (status, latency)
        deadline = time.monotonic() + HEADER_TIMEOUT + 3.0
        answers = [read_until_closed(s, deadline) for s in flood]
    finally:
        for sock in flood:
            sock.close()
    assert all(a is not None for a in answers), "connections still held after the header timeout"
    evicted = sum(a.startswith(b"HTTP/1.1 503") for a in answers if a)
    timed_out = sum(a.startswith(b"HTTP/1.1 408") for a in answers if a)
    assert evicted + timed_out == len(flood)
    assert evicted >= len(flood) - MAX_CONNECTIONS - 5, (evicted, timed_out)  # never more than the limit held


def test_busy_connections_past_the_limit_get_503_not_a_hang(server: ServerProcess) -> None:
    """When every connection has a request in progress nothing can be evicted: a new
    connection is answered 503 at once; once the slow bodies time out, /health is back."""
    busy = []
    for _ in range(MAX_CONNECTIONS):
        sock = socket.create_connection((server.host, server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        busy.append(sock)
    try:
        time.sleep(0.2)  # every head parsed
        status, latency = health_latency(server.url)  # 0: closed before httpx read the 503
        assert status in (503, 0) and latency < HEALTH_BUDGET_S, (status, latency)
        deadline = time.monotonic() + BODY_TIMEOUT + 3.0
        answers = [read_until_closed(s, deadline) for s in busy]
    finally:
        for sock in busy:
            sock.close()
    assert all(a is not None and a.startswith(b"HTTP/1.1 408") for a in answers)
    assert health_latency(server.url)[0] == 200


# ---- 6. a client that leaves during the upload -----------------------------------------------------


def test_a_client_leaving_mid_upload_is_no_500(server: ServerProcess, client: httpx.Client) -> None:
    """Before: each was a 500 with two tracebacks in the log (1,500 sockets: ~143k lines)."""
    before_errors = error_counts(client)
    before_lines = len(server.lines)
    for _ in range(50):
        sock = socket.create_connection((server.host, server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000\r\n\r\n" + b"a" * 100)
        sock.close()
    time.sleep(0.5)
    assert health_latency(server.url)[0] == 200
    assert error_counts(client).get("500", 0) == before_errors.get("500", 0)
    new_lines = server.lines[before_lines:]
    assert not any("Traceback" in line for line in new_lines), "".join(new_lines[:40])
    assert len(new_lines) < 20, "".join(new_lines[:40])


# ---- 8. smaller ones ------------------------------------------------------------------------------


def test_a_trailing_slash_is_no_redirect(client: httpx.Client) -> None:
    """Before: POST /v1/completions/ answered 307 to whatever Host the client sent."""
    response = client.post("/v1/completions/", json={"prompt": "x"}, headers={"Host": "evil.example"})
    assert response.status_code == 404, response.headers
    assert "location" not in response.headers


def test_summarize_params_is_bounded() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.5, seed=7)
    params.stop = ["stop" * 100_000] * 10_000  # past the caps: what a log line must survive anyway
    params.logit_bias = {i: 1.0 for i in range(100_000)}
    params.stop_token_ids = list(range(100_000))
    line = summarize_params(params)
    assert len(line) <= SUMMARY_MAX_CHARS
    assert "max_tokens=5" in line and "temperature=0.5" in line and "seed=7" in line
    assert "10000 items" in line or "100000 items" in line
    short = summarize_params(SamplingParams(max_tokens=3, stop=["\n"]))
    assert short == "SamplingParams(max_tokens=3, stop=['\\n'])"


def test_log_volume_stays_bounded(server: ServerProcess) -> None:
    """Everything above (hundreds of refused, evicted and timed-out connections) left a
    bounded log: per kind of line, at most a burst per interval."""
    assert len(server.lines) < 300, len(server.lines)


def test_the_rate_limit_filter() -> None:
    limiter = RateLimitFilter(burst=3, total=5, interval=60.0)
    record = lambda msg: logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)  # noqa: E731
    passed = [limiter.filter(record("socket.accept() out of system resource\nsocket: <fd=%d>" % i)) for i in range(100)]
    assert sum(passed) == 3
    assert sum(limiter.filter(record(f"other {i}")) for i in range(10)) == 2  # the total cap
    assert limiter.dropped_total == 97 + 8


def test_connection_settings() -> None:
    args = build_parser().parse_args(
        ["serve", "--max-connections", "10", "--header-timeout", "2.5", "--body-timeout", "7"])
    server_settings, _, _ = load_settings(args)
    assert (server_settings.max_connections, server_settings.header_timeout, server_settings.body_timeout) == (
        10, 2.5, 7.0)
    from_file, _ = merge_settings({"max_connections": 99, "header_timeout": 1, "body_timeout": 2}, {})
    assert (from_file.max_connections, from_file.header_timeout, from_file.body_timeout) == (99, 1, 2)
    for bad in ({"max_connections": 0}, {"header_timeout": 0}, {"body_timeout": -1}):
        with pytest.raises(SettingsError):
            merge_settings(bad, {})
    assert raise_fd_limit(64) >= 64


def test_a_frame_the_core_cannot_take_fails_its_request_not_the_core():
    """A request whose params fail the core's own checks (the front end checks them first; a
    process-wide flush-to-zero once turned a top_p of 5e-324 into 0.0 between the two) ends
    with an error output, and the core loop goes on."""
    import msgspec

    from graphserve.engine.core.loop import CoreLoop
    from graphserve.engine.core.messages import AddRequest, decode_from_core, encode
    from graphserve.engine.request import SamplingParams

    class Socket:
        def __init__(self):
            self.sent = []

        def send_multipart(self, parts, copy=False):
            self.sent.append(parts)

    loop = CoreLoop.__new__(CoreLoop)  # only its socket is needed to refuse a frame
    loop.socket = Socket()
    raw = msgspec.msgpack.decode(encode(AddRequest("r1", [1, 2], SamplingParams())))
    raw[3]["top_p"] = 0.0
    loop._refuse(b"frontend", msgspec.msgpack.encode(raw))
    (identity, frame), = loop.socket.sent
    out, = decode_from_core(frame).outputs
    assert identity == b"frontend" and out.request_id == "r1" and out.finish_reason == "error"
