"""Reliability under stress, against real `python -m graphserve serve` processes on loopback
(CPU, the embedded model): a soak of 1,000 requests at concurrency 64, schemathesis
fuzzing of the server's own OpenAPI schema, SIGTERM during 32 streams, and engine
faults injected through the tests-only /debug/fault route. Every test is bounded in
time; the soak's figures go to the terminal, and to the JSON file $SOAK_REPORT names (if set;
benchmarks/results/reliability-soak.json holds a recorded run).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")

from live_server import ServerProcess, sse_payloads

REPO = Path(__file__).resolve().parent.parent
FAULTS_ENV = {"GRAPHSERVE_ENABLE_FAULT_INJECTION": "1"}
CPU_ARGS = ["--device", "cpu", "--max-model-len", "256", "--decode-chunk", "4"]

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def add(a, b):",
    "Water boils at",
    "The quick brown fox",
    "My favourite colour is",
    "1, 2, 3, 4,",
    "The largest planet is",
    "Hello, my name is",
    "To make tea, first",
    "The opposite of hot is",
    "In the morning I",
]


# ---- helpers ----------------------------------------------------------------------------------


def metrics(client: httpx.Client) -> dict[str, float]:
    return parse_metrics(client.get("/metrics").text)


def parse_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_until_idle(client: httpx.Client, free_blocks: float, timeout: float) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the free KV blocks are back to `free_blocks`."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(client)
        idle = values["graphserve_num_requests_running"] == values["graphserve_num_requests_waiting"] == 0
        if idle and values["graphserve_kv_blocks_free"] == free_blocks:
            return values
        if time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def assert_error_body(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    if status is not None:
        assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert_no_internals(response.text)
    return error


def assert_no_internals(text: str) -> None:
    """No traceback, source location or server path in anything a client reads."""
    for leak in ("Traceback", 'File "', str(REPO), ".py", "site-packages"):
        assert leak not in text, f"{leak!r} in response: {text[:500]}"


def without_generated_text(response) -> str:
    """What the server wrote itself: a response body (or each SSE event) without its choices,
    whose text the model wrote and may hold anything ("crypto.python" is not a leak)."""
    if response.status_code >= 400:
        return response.text

    def strip(payload: str) -> str:
        try:
            body = json.loads(payload)
        except ValueError:
            return payload
        if isinstance(body, dict):
            body.pop("choices", None)
        return json.dumps(body)

    content_type = response.headers.get("content-type") or ""
    if isinstance(content_type, list):  # schemathesis' response: every header a list
        content_type = content_type[0] if content_type else ""
    if content_type.startswith("text/event-stream"):
        return "\n".join(strip(line[6:]) if line.startswith("data: ") else line for line in response.text.splitlines())
    return strip(response.text)


def completion_body(path: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def output_text(path: str, body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


def streamed_text(path: str, events: list[dict[str, Any]]) -> str:
    pieces = []
    for event in events:
        for choice in event["choices"]:
            pieces.append(choice["text"] if path == "/v1/completions" else choice["delta"].get("content", ""))
    return "".join(pieces)


async def read_stream(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """Status and the `data:` payloads of a streamed request, read to the end."""
    async with http.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, [response.text]
        return 200, sse_payloads([line async for line in response.aiter_lines()])


# ---- soak ---------------------------------------------------------------------------------------

SOAK_REQUESTS = 1000
SOAK_CONCURRENCY = 64
SOAK_DISCONNECT_SHARE = 0.20
SOAK_MALFORMED_SHARE = 0.05
SOAK_DEADLINE_S = 300.0
SOAK_PATHS = ("/v1/completions", "/v1/chat/completions")

# (path, raw body): each must be a 4xx with the OpenAI error body
MALFORMED: list[tuple[str, bytes]] = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2'),
    ("/v1/completions", b"[]"),
    ("/v1/completions", b""),
    ("/v1/completions", b'{"prompt": 42}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": -3}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}'),
    ("/v1/completions", b'{"prompt": "hi", "model": "no-such-model"}'),
    ("/v1/completions", b'{"prompt": [999999999], "stream": true}'),
    ("/v1/chat/completions", b'{"messages": "hello"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
    ("/v1/chat/completions", b"\xff\xfe not json at all"),
    ("/v1/chat/completions", b'{"messages": [], "stream": true}'),
]


@dataclass(frozen=True)
class SoakRequest:
    kind: str  # "valid" | "disconnect" | "malformed"
    path: str
    stream: bool
    spec: int = 0  # valid: index into the distinct greedy requests; malformed: into MALFORMED
    read_events: int = 0  # disconnecting stream: events read before closing
    wait_s: float = 0.0  # disconnecting non-stream: seconds before hanging up


@dataclass
class SoakResult:
    request: SoakRequest
    status: int | None = None
    text: str | None = None
    events_seen: int = 0
    latency_s: float = 0.0
    error: str | None = None  # a transport error or a broken response
    hung_up: bool = False


@dataclass
class SoakFigures:
    requests: int = 0
    valid: int = 0
    completed: int = 0
    disconnects: int = 0
    disconnects_mid_stream: int = 0
    malformed: int = 0
    malformed_4xx: int = 0
    server_errors_5xx: int = 0
    valid_5xx: int = 0
    mismatched_outputs: int = 0
    transport_errors: int = 0
    aborted_by_server: int = 0
    leaked_kv_blocks: int = 0
    left_running: int = 0
    left_waiting: int = 0
    p50_latency_s: float = 0.0
    p99_latency_s: float = 0.0
    wall_s: float = 0.0
    requests_per_s: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)


def distinct_requests() -> list[tuple[str, str, int]]:
    """The greedy requests the soak repeats: (path, prompt, max_tokens 1..4)."""
    return [(path, prompt, 1 + (i + j) % 4) for i, prompt in enumerate(PROMPTS) for j, path in enumerate(SOAK_PATHS)]


def soak_plan(rng: random.Random) -> list[SoakRequest]:
    num_malformed = round(SOAK_REQUESTS * SOAK_MALFORMED_SHARE)
    num_disconnect = round(SOAK_REQUESTS * SOAK_DISCONNECT_SHARE)
    num_distinct = len(distinct_requests())
    plan = [
        SoakRequest("malformed", MALFORMED[i % len(MALFORMED)][0], False, spec=i % len(MALFORMED))
        for i in range(num_malformed)
    ]
    for i in range(num_disconnect):
        stream = i % 2 == 0
        plan.append(
            SoakRequest(
                "disconnect",
                SOAK_PATHS[i % 4 // 2],
                stream,
                read_events=rng.randint(0, 3) if stream else 0,
                wait_s=0.0 if stream else rng.uniform(0.05, 1.5),
            )
        )
    for i in range(SOAK_REQUESTS - num_malformed - num_disconnect):
        spec = rng.randrange(num_distinct)
        plan.append(SoakRequest("valid", distinct_requests()[spec][0], rng.random() < 0.5, spec=spec))
    rng.shuffle(plan)
    return plan


async def run_one(http: httpx.AsyncClient, request: SoakRequest) -> SoakResult:
    result = SoakResult(request)
    start = time.monotonic()
    try:
        if request.kind == "malformed":
            path, raw = MALFORMED[request.spec]
            response = await http.post(path, content=raw, headers={"Content-Type": "application/json"})
            result.status = response.status_code
            if 400 <= response.status_code < 500:
                assert_error_body(response)
        elif request.kind == "valid":
            path, prompt, max_tokens = distinct_requests()[request.spec]
            body = completion_body(path, prompt, max_tokens)
            if request.stream:
                result.status, payloads = await read_stream(http, path, body)
                if result.status == 200:
                    if not payloads or payloads[-1] != "[DONE]":
                        raise AssertionError(f"stream did not end with [DONE]: {payloads[-2:]}")
                    events = [json.loads(p) for p in payloads[:-1]]
                    if any("error" in e for e in events):
                        raise AssertionError(f"error event in a valid stream: {events[-1]}")
                    result.text = streamed_text(path, events)
            else:
                response = await http.post(path, json=body)
                result.status = response.status_code
                if response.status_code == 200:
                    result.text = output_text(path, response.json())
        elif request.stream:  # disconnect mid-stream
            body = completion_body(request.path, PROMPTS[0], 64, ignore_eos=True, stream=True)
            async with http.stream("POST", request.path, json=body) as response:
                result.status = response.status_code
                if request.read_events:
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            result.events_seen += 1
                            if result.events_seen >= request.read_events:
                                break
            result.hung_up = True  # leaving the block closes the connection mid-stream
        else:  # disconnect while a non-streaming request runs
            body = completion_body(request.path, PROMPTS[1], 64, ignore_eos=True)
            try:
                response = await asyncio.wait_for(http.post(request.path, json=body), request.wait_s)
                result.status = response.status_code
            except TimeoutError:
                result.hung_up = True
    except (httpx.HTTPError, AssertionError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.monotonic() - start
    return result


async def run_soak(url: str, plan: list[SoakRequest]) -> list[SoakResult]:
    queue: asyncio.Queue[SoakRequest] = asyncio.Queue()
    for request in plan:
        queue.put_nowait(request)
    results: list[SoakResult] = []
    limits = httpx.Limits(max_connections=SOAK_CONCURRENCY * 2, max_keepalive_connections=SOAK_CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as http:

        async def worker() -> None:
            while not queue.empty():
                results.append(await run_one(http, queue.get_nowait()))

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(SOAK_CONCURRENCY))), SOAK_DEADLINE_S)
    return results


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_soak_1000_requests_at_concurrency_64(
    record_property: pytest.RecordProperty, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*CPU_ARGS, "--max-num-seqs", "32", "--kv-cache-bytes", "128MiB", "--log-level", "warning"]
    with ServerProcess(args) as server:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=120.0) as client:
            # each distinct greedy request alone first: the reference outputs
            solo = [
                output_text(path, client.post(path, json=completion_body(path, prompt, max_tokens)).json())
                for path, prompt, max_tokens in distinct_requests()
            ]
            # the engine's figures reach the front end a moment after its requests end
            before = wait_until_idle(client, metrics(client)["graphserve_kv_blocks_total"], timeout=10.0)
            start_free = before["graphserve_kv_blocks_free"]
            assert start_free == before["graphserve_kv_blocks_total"]

            plan = soak_plan(random.Random(20261129))
            started = time.monotonic()
            try:
                results = asyncio.run(run_soak(server.url, plan))
            except TimeoutError:
                pytest.fail(f"streams still open at the {SOAK_DEADLINE_S:.0f} s deadline")
            wall = time.monotonic() - started
            after = wait_until_idle(client, start_free, timeout=30.0)
            assert client.post("/debug/fault", json={"kind": "step"}).status_code == 404, "no fault route by default"
        assert server.process.poll() is None, server.log

    figures = soak_figures(results, solo, before, after, wall)
    write_figures(figures, record_property, capsys)
    by_kind = Counter(r.request.kind for r in results)
    assert len(results) == SOAK_REQUESTS and by_kind["malformed"] == figures.malformed
    broken = [r for r in results if r.error and r.request.kind != "disconnect"]
    assert not broken, broken[:5]
    assert figures.transport_errors == 0, [r for r in results if r.error][:5]  # disconnects included
    assert figures.valid_5xx == 0 and figures.server_errors_5xx == 0, figures.statuses
    bad_malformed = [r for r in results if r.request.kind == "malformed" and not 400 <= (r.status or 0) < 500]
    assert not bad_malformed, bad_malformed[:5]
    assert figures.completed == figures.valid, "every valid request completed with 200"
    assert figures.mismatched_outputs == 0, "each greedy output equals the same request run alone"
    assert figures.left_running == figures.left_waiting == 0 and figures.leaked_kv_blocks == 0, figures
    # every client that hung up mid-stream had its engine request aborted (others may have
    # left before the server even started theirs: the idle engine above shows none leaked)
    assert figures.disconnects_mid_stream <= figures.aborted_by_server <= figures.disconnects, figures


def soak_figures(
    results: list[SoakResult], solo: list[str], before: dict[str, float], after: dict[str, float], wall: float
) -> SoakFigures:
    statuses = Counter(str(r.status) if r.status is not None else "none" for r in results)
    valid = [r for r in results if r.request.kind == "valid"]
    completed = [r for r in valid if r.status == 200 and r.text is not None]
    aborted = 'graphserve_requests_total{finish_reason="abort"}'
    return SoakFigures(
        requests=len(results),
        valid=len(valid),
        completed=len(completed),
        disconnects=sum(r.request.kind == "disconnect" for r in results),
        disconnects_mid_stream=sum(r.request.kind == "disconnect" and r.events_seen > 0 for r in results),
        malformed=sum(r.request.kind == "malformed" for r in results),
        malformed_4xx=sum(r.request.kind == "malformed" and 400 <= (r.status or 0) < 500 for r in results),
        server_errors_5xx=sum((r.status or 0) >= 500 for r in results),
        valid_5xx=sum((r.status or 0) >= 500 for r in valid),
        mismatched_outputs=sum(r.text != solo[r.request.spec] for r in completed),
        transport_errors=sum(r.error is not None for r in results),
        aborted_by_server=int(after.get(aborted, 0) - before.get(aborted, 0)),
        leaked_kv_blocks=int(before["graphserve_kv_blocks_free"] - after["graphserve_kv_blocks_free"]),
        left_running=int(after["graphserve_num_requests_running"]),
        left_waiting=int(after["graphserve_num_requests_waiting"]),
        p50_latency_s=round(percentile([r.latency_s for r in completed], 0.50), 3),
        p99_latency_s=round(percentile([r.latency_s for r in completed], 0.99), 3),
        wall_s=round(wall, 1),
        requests_per_s=round(len(results) / wall, 1),
        statuses=dict(sorted(statuses.items())),
    )


def write_figures(
    figures: SoakFigures, record_property: pytest.RecordProperty, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {"concurrency": SOAK_CONCURRENCY, **asdict(figures)}
    if os.environ.get("SOAK_REPORT"):  # not into the repository on every test run
        Path(os.environ["SOAK_REPORT"]).write_text(json.dumps(data, indent=2) + "\n")
    for key, value in data.items():
        record_property(key, value)
    line = ", ".join(f"{key} {value}" for key, value in data.items() if key != "statuses")
    with capsys.disabled():  # shown with or without -s
        print(f"\nsoak: {line}; statuses {figures.statuses}")


# ---- fuzz ---------------------------------------------------------------------------------------

FUZZ_EXAMPLES = 40  # per operation and generation mode


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    # a small context and queue keep every generation short: n x max_tokens <= 8 x 64
    args = ["--device", "cpu", "--max-model-len", "64", "--decode-chunk", "4", "--max-num-seqs", "8"]
    args += ["--max-queue-len", "8", "--kv-cache-bytes", "16MiB", "--log-level", "warning"]
    with ServerProcess(args) as server:
        server.wait_ready()
        yield server
        assert server.process.poll() is None, server.log


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_fuzz_against_the_openapi_schema(
    fuzz_server: ServerProcess, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """schemathesis: schema-valid and schema-violating bodies; never a 5xx, every response
    as documented (status, content type, body schema), nothing internal leaked."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operation = schema[path]["POST"]
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]
    seen: Counter[int] = Counter()

    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(mode))
        def fuzz(case: Any) -> None:
            response = case.call(base_url=fuzz_server.url, timeout=60)
            seen[response.status_code] += 1
            case.validate_response(response, checks=checks)
            assert_no_internals(without_generated_text(response))

        fuzz()
    with capsys.disabled():  # shown with or without -s
        print(f"\nfuzz {path}: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
    assert seen[200] > 0 and sum(seen.values()) >= FUZZ_EXAMPLES, seen
    with httpx.Client(base_url=fuzz_server.url) as client:
        assert client.get("/health").status_code == 200


# ---- shutdown -------------------------------------------------------------------------------------

SHUTDOWN_STREAMS = 32


async def streams_with_sigterm(
    server: ServerProcess, max_tokens: int, while_draining: dict[str, Any]
) -> list[list[str]]:
    """Open the streams; once each has its first event, SIGTERM the server, then probe it."""
    first_events = 0
    all_started = asyncio.Event()
    limits = httpx.Limits(max_connections=SHUTDOWN_STREAMS + 4)

    async with httpx.AsyncClient(base_url=server.url, timeout=120.0, limits=limits) as http:

        async def one(i: int) -> list[str]:
            nonlocal first_events
            body = completion_body(
                "/v1/completions", PROMPTS[i % len(PROMPTS)], max_tokens, ignore_eos=True, stream=True,
                stream_options={"include_usage": True},
            )
            payloads: list[str] = []
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        payloads.append(line[5:].strip())
                        if len(payloads) == 1:
                            first_events += 1
                            if first_events == SHUTDOWN_STREAMS:
                                all_started.set()
            return payloads

        tasks = [asyncio.ensure_future(one(i)) for i in range(SHUTDOWN_STREAMS)]
        await asyncio.wait_for(all_started.wait(), 120)
        server.terminate()  # what `docker stop` and Kubernetes send
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as fresh:  # a new client, new connections
            health = await fresh.get("/health")
            new_request = await fresh.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        while_draining.update(
            health=health.status_code,
            health_body=health.json(),
            new_request=new_request.status_code,
            new_request_error=new_request.json()["error"],
            running=sum(not t.done() for t in tasks),
        )
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)


def test_sigterm_during_32_streams_lets_them_finish_and_exits_0() -> None:
    args = [*CPU_ARGS, "--max-num-seqs", "32", "--kv-cache-bytes", "64MiB", "--shutdown-timeout", "120"]
    with ServerProcess(args) as server:
        server.wait_ready()
        probes: dict[str, Any] = {}
        results = asyncio.run(streams_with_sigterm(server, 48, probes))
        assert server.wait(60) == 0, server.log
    assert probes["running"] > 0, "the probes ran while streams were still running"
    assert probes["health"] == 503 and probes["health_body"]["status"] == "draining"
    assert probes["new_request"] == 503 and probes["new_request_error"]["code"] == "shutting_down"
    for payloads in results:
        assert payloads[-1] == "[DONE]"
        usage = json.loads(payloads[-2])["usage"]
        assert usage["completion_tokens"] == 48, "every running stream finished"


def test_sigterm_past_the_shutdown_timeout_ends_streams_with_a_clean_error() -> None:
    args = [*CPU_ARGS, "--max-num-seqs", "32", "--kv-cache-bytes", "64MiB", "--shutdown-timeout", "1"]
    with ServerProcess(args) as server:
        server.wait_ready()
        probes: dict[str, Any] = {}
        results = asyncio.run(streams_with_sigterm(server, 200, probes))
        assert server.wait(60) == 0, server.log
    for payloads in results:
        assert payloads[-1] == "[DONE]"
        last = json.loads(payloads[-2])
        assert last["error"]["code"] == "shutting_down" and last["error"]["type"] == "service_unavailable_error"


# ---- engine faults -------------------------------------------------------------------------------


async def in_flight_then_fault(server: ServerProcess, kind: str, streams: int, plain: int) -> tuple[list, list]:
    """Start `streams` streaming and `plain` non-streaming requests, wait until all run,
    inject the fault, and return (stream payload lists, plain responses)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=120.0) as http:
        body = completion_body("/v1/completions", PROMPTS[2], 200, ignore_eos=True)
        stream_tasks = [asyncio.ensure_future(read_stream(http, "/v1/completions", body)) for _ in range(streams)]
        plain_tasks = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(plain)]
        deadline = time.monotonic() + 60
        while True:
            values = parse_metrics((await http.get("/metrics")).text)
            if values["graphserve_num_requests_running"] == streams + plain:
                break
            assert time.monotonic() < deadline, values
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # past their prefill: all of them are in every decode round now
        injected = await http.post("/debug/fault", json={"kind": kind})
        assert injected.status_code == 200 and injected.json() == {"injected": kind}
        stream_results = await asyncio.wait_for(asyncio.gather(*stream_tasks), 60)
        plain_results = await asyncio.wait_for(asyncio.gather(*plain_tasks), 60)
    return stream_results, plain_results


def test_a_step_fault_fails_only_the_requests_in_that_step() -> None:
    args = [*CPU_ARGS, "--max-num-seqs", "8", "--kv-cache-bytes", "32MiB"]
    with ServerProcess(args, env=FAULTS_ENV) as server:
        server.wait_ready()
        streams, plain = asyncio.run(in_flight_then_fault(server, "step", streams=2, plain=2))
        for response in plain:
            error = assert_error_body(response, 500)
            assert error["type"] == "internal_error" and error["code"] == "internal_error"
        for status, payloads in streams:
            assert status == 200 and payloads[-1] == "[DONE]"
            error = json.loads(payloads[-2])["error"]
            assert error["code"] == "internal_error"
            assert_no_internals(payloads[-2])
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            assert client.get("/health").status_code == 200
            for path in SOAK_PATHS:  # the engine goes on
                response = client.post(path, json=completion_body(path, PROMPTS[0], 4))
                assert response.status_code == 200, response.text
            total = metrics(client)["graphserve_kv_blocks_total"]
            after = wait_until_idle(client, total, timeout=10.0)
            assert after["graphserve_kv_blocks_free"] == total
            assert after['graphserve_request_errors_total{status="500"}'] == 2
        assert server.process.poll() is None
    log = server.log
    assert "Traceback" in log and "injected step fault" in log, "the failure is logged with its traceback"
    assert PROMPTS[2] not in log and PROMPTS[0] not in log, "prompts are not logged without --log-requests"


def test_a_fatal_fault_turns_health_503_and_exits_non_zero() -> None:
    args = [*CPU_ARGS, "--max-num-seqs", "4", "--kv-cache-bytes", "16MiB"]
    with ServerProcess(args, env=FAULTS_ENV) as server:
        server.wait_ready()
        streams, _ = asyncio.run(in_flight_then_fault(server, "fatal", streams=1, plain=0))
        health = httpx.get(server.url + "/health", timeout=5.0)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        status, payloads = streams[0]
        assert status == 200 and payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["error"]["code"] == "engine_dead"
        code = server.wait(60)
    assert code != 0, server.log
    assert re.search(r"engine (loop )?died", server.log), server.log
