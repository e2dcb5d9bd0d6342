"""Limits and security at the HTTP edge: body size (413), back-pressure (429 with
Retry-After), caps on n / logprobs, max_tokens clamped when left out, the API key on
every API route, CORS off unless configured, the tests-only fault route, settings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")

from graphserve import AsyncEngine, EngineConfig
from graphserve.engine.llm_engine import EngineStats
from graphserve.server.app import create_app
from graphserve.server.cli import build_parser, load_settings
from graphserve.server.settings import SettingsError, fault_injection_enabled, merge_settings
from live_server import BackgroundServer

API_KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 128
MAX_QUEUE_LEN = 4
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    config = EngineConfig(
        model=None,
        device="cpu",
        max_num_seqs=2,
        decode_chunk=4,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=16 * 1024**2,
    )
    app = create_app(AsyncEngine(config), api_key=API_KEY, max_queue_len=MAX_QUEUE_LEN, max_body_bytes=MAX_BODY_BYTES)
    with BackgroundServer(app) as background:
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as http:
        yield http


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


class IdleEngine:
    """An engine that never finishes loading: enough for routes that answer before it."""

    dead = False
    ready = False
    error = None

    async def start(self) -> None:
        await asyncio.Event().wait()

    async def shutdown(self) -> None:
        return None

    def stats(self) -> EngineStats:
        return EngineStats()


# ---- body size ----------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413(client: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    error = assert_error(client.post("/v1/completions", content=big), 413)
    assert error["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 4096 + 1):
            yield b"a" * 4096
        yield b'"}'

    assert_error(client.post("/v1/chat/completions", content=chunked()), 413)
    assert_error(client.post("/tokenize", content=big), 413)
    # just under the limit is served
    padded = b'{"prompt": "Hi", "max_tokens": 1' + b" " * (MAX_BODY_BYTES - 64) + b"}"
    assert client.post("/v1/completions", content=padded).status_code == 200


# ---- back-pressure -------------------------------------------------------------------------------


def test_a_full_queue_answers_429_with_retry_after(server: BackgroundServer) -> None:
    """2 running (max_num_seqs) + 4 waiting (max_queue_len): the next request is a 429."""
    state = server.app.state.graphserve

    async def scenario() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60.0) as http:
            body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 100, "ignore_eos": True, "stream": True}
            streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(2 + MAX_QUEUE_LEN)]
            # a request counts as queued until its first output: start 2, let them run, then queue 4
            opened = [asyncio.ensure_future(s.__aenter__()) for s in streams[:2]]
            await until(lambda: state.engine.stats().num_running == 2 and state.admission.queued == 0)
            opened += [asyncio.ensure_future(s.__aenter__()) for s in streams[2:]]
            await until(lambda: state.admission.queued == MAX_QUEUE_LEN)
            responses = [await task for task in opened]
            assert [r.status_code for r in responses] == [200] * len(opened)
            full = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            chat = {"messages": [{"role": "user", "content": "x"}], "stream": True}
            full_stream = await http.post("/v1/chat/completions", json=chat)
            too_many_body = {"prompt": "hi", "max_tokens": 1, "n": MAX_QUEUE_LEN + 1}
            too_many = await http.post("/v1/completions", json=too_many_body)
            for response in responses:
                await response.aclose()  # hang up: the queued and running requests are aborted
            for stream in streams:
                await stream.__aexit__(None, None, None)
            return {"full": full, "full_stream": full_stream, "too_many": too_many}

    responses = asyncio.run(scenario())
    error = assert_error(responses["full"], 429)
    assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
    assert responses["full"].headers["retry-after"] == "1"
    assert_error(responses["full_stream"], 429)
    assert assert_error(responses["too_many"], 400)["param"] == "n"
    deadline = time.monotonic() + 10
    while state.admission.queued or state.admission.active or state.engine.stats().num_running:
        assert time.monotonic() < deadline, state.admission
        time.sleep(0.02)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


# ---- caps and max_tokens ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "hi", "n": 129}, "n"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, "n"),  # 6 generations > the queue of 4
    ],
)
def test_n_and_logprobs_are_capped(client: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    assert assert_error(client.post(path, json=body), 400)["param"] == param


def test_max_tokens_left_out_is_clamped_to_what_fits(client: httpx.Client) -> None:
    prompt = " ".join(["word"] * 120)
    count = client.post("/tokenize", json={"prompt": prompt}).json()["count"]
    room = MAX_MODEL_LEN - count
    assert 0 < room < 16
    # completions: OpenAI's default of 16 shrinks to the room left; null takes all of it
    for extra in ({}, {"max_tokens": None}):
        body = client.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True, **extra}).json()
        assert body["usage"]["completion_tokens"] == room and body["choices"][0]["finish_reason"] == "length"
    # a max_tokens the client chose is not silently cut
    error = assert_error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16}), 400)
    assert error["code"] == "context_length_exceeded"
    # chat: left out, generation fills the context
    messages = [{"role": "user", "content": " ".join(["word"] * 60)}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True}).json()
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN


# ---- security ----------------------------------------------------------------------------------------


def test_every_api_route_needs_the_api_key(server: BackgroundServer) -> None:
    paths = server.app.openapi()["paths"]
    api_routes = [
        (method.upper(), path.replace("{model}", "x"))
        for path, operations in paths.items()
        if path not in ("/health", "/metrics")
        for method in operations
    ]
    assert len(api_routes) >= 6 and all(path.startswith(("/v1/", "/tokenize", "/detokenize")) for _, path in api_routes)
    wrong_keys = ({}, {"Authorization": "Bearer " + "x" * len(API_KEY)}, {"Authorization": API_KEY})
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        for method, path in api_routes:
            for headers in wrong_keys:
                response = http.request(method, path, json={}, headers=headers)
                assert assert_error(response, 401)["code"] == "invalid_api_key", (method, path)
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200


def test_error_responses_carry_no_tracebacks_or_paths(client: httpx.Client) -> None:
    text = client.post("/v1/completions", content=b"{not json").text
    assert "Traceback" not in text and ".py" not in text


def test_cors_is_off_unless_configured(client: httpx.Client) -> None:
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    response = client.options("/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in response.headers
    response = client.get("/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in response.headers


def test_cors_allows_only_the_configured_origins() -> None:
    app = create_app(IdleEngine(), allowed_origins=["https://ui.example"])
    with BackgroundServer(app) as background, httpx.Client(base_url=background.url) as http:
        allowed = {
            "Origin": "https://ui.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        }
        response = http.options("/v1/completions", headers=allowed)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://ui.example"
        other = http.options("/v1/completions", headers={**allowed, "Origin": "https://evil.example"})
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"


def test_the_fault_route_exists_only_with_the_switch() -> None:
    for enabled, status in ((False, 404), (True, 503)):  # 503: the route is there, the engine not ready
        app = create_app(IdleEngine(), enable_fault_injection=enabled)
        with BackgroundServer(app) as background, httpx.Client(base_url=background.url) as http:
            assert http.post("/debug/fault", json={"kind": "step"}).status_code == status
            assert "/debug/fault" not in http.get("/openapi.json").text
    assert fault_injection_enabled({"GRAPHSERVE_ENABLE_FAULT_INJECTION": "1"})
    assert not fault_injection_enabled({}) and not fault_injection_enabled({"GRAPHSERVE_ENABLE_FAULT_INJECTION": "0"})


# ---- settings -------------------------------------------------------------------------------------------


def test_limit_flags_and_config_keys() -> None:
    origins = "https://a.example, https://b.example"
    flags = ["--max-queue-len", "32", "--max-body-bytes", "2MiB", "--allowed-origins", origins]
    args = build_parser().parse_args(["serve", *flags])
    server, _, _ = load_settings(args)
    assert server.max_queue_len == 32 and server.max_body_bytes == 2 * 1024**2
    assert server.allowed_origins == ["https://a.example", "https://b.example"]
    defaults, _ = merge_settings({}, {})
    assert defaults.max_queue_len == 256 and defaults.max_body_bytes == 1024**2 and defaults.allowed_origins is None
    from_file, _ = merge_settings({"max_queue_len": 8, "max_body_bytes": "64KiB", "allowed_origins": ["*"]}, {})
    assert (from_file.max_queue_len, from_file.max_body_bytes, from_file.allowed_origins) == (8, 65536, ["*"])
    with pytest.raises(SettingsError):
        merge_settings({"max_queue_len": 0}, {})
