"""Every error the HTTP server returns: status code and OpenAI error body. Bad input is
always a 4xx (never 422, never 5xx); the server runs with --api-key here."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve import AsyncEngine, EngineConfig
from graphserve.server.app import create_app
from live_server import BackgroundServer

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
CHAT = [{"role": "user", "content": "Hi"}]

before_ready: dict[str, int] = {}
engine_failures: list[BaseException] = []


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    config = EngineConfig(
        model=None, device="cpu", max_num_seqs=4, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=32 * 1024**2
    )
    app = create_app(AsyncEngine(config), api_key=API_KEY, on_engine_failure=engine_failures.append)
    with BackgroundServer(app) as background:
        # the model takes seconds to load: these land while it does
        with httpx.Client(base_url=background.url, headers=AUTH) as early:
            before_ready["health"] = early.get("/health").status_code
            before_ready["completions"] = early.post("/v1/completions", json={"prompt": "hi"}).status_code
            before_ready["models"] = early.get("/v1/models").status_code
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as http:
        yield http


def assert_error(response: httpx.Response, status: int, param: str | None = "any") -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param != "any":
        assert error["param"] == param, error
    return error


def test_503_while_the_model_loads(server: BackgroundServer) -> None:
    assert before_ready == {"health": 503, "completions": 503, "models": 503}


BAD_COMPLETIONS = [
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.01}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 only with echo (prompt scoring)
    ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": [1, "two"]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "stream": "yes please"}, "stream"),
    ({"prompt": "hi", "stop": 7}, "stop"),
    ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"10": 500}}, "logit_bias.10"),
    ({"prompt": "hi", "logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"prompt": "hi", "stream_options": 5}, "stream_options"),
    ({"prompt": "hi", "echo": "maybe"}, "echo"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[str(b) for b, _ in BAD_COMPLETIONS])
def test_bad_completion_parameters_are_400(client: httpx.Client, body: dict[str, Any], param: str) -> None:
    error = assert_error(client.post("/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"
    # the same body streamed is rejected the same way, before any event
    streamed = body if "stream" in body else {**body, "stream": True}
    assert_error(client.post("/v1/completions", json=streamed), 400, param)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
    ({"messages": CHAT, "temperature": -1}, "temperature"),
    ({"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": CHAT, "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "max_tokens": 10_000}, "max_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS, ids=[str(b) for b, _ in BAD_CHATS])
def test_bad_chat_requests_are_400(client: httpx.Client, body: dict[str, Any], param: str | None) -> None:
    error = assert_error(client.post("/v1/chat/completions", json=body), 400)
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"null", b'"text"'])
def test_invalid_json_is_400(client: httpx.Client, path: str, raw: bytes) -> None:
    assert_error(client.post(path, content=raw, headers={"Content-Type": "application/json"}), 400)


def test_json_without_content_type_is_accepted(client: httpx.Client) -> None:
    """`curl -d '{...}'` sends application/x-www-form-urlencoded."""
    response = client.post(
        "/v1/completions",
        content=b'{"prompt": "Hi", "max_tokens": 2}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 200, response.text


def test_prompt_plus_max_tokens_beyond_max_model_len_is_400_naming_both(client: httpx.Client) -> None:
    prompt_tokens = client.post("/tokenize", json={"prompt": "one two three"}).json()["count"]
    max_tokens = MAX_MODEL_LEN - prompt_tokens + 1
    error = assert_error(
        client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": max_tokens}), 400
    )
    assert str(max_tokens) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    assert str(prompt_tokens) in error["message"]
    assert error["code"] == "context_length_exceeded"

    long_prompt = [1000] * (MAX_MODEL_LEN + 5)
    error = assert_error(client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}), 400)
    assert str(MAX_MODEL_LEN + 5) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    # one too-long prompt among several rejects the whole request, before any token
    assert_error(client.post("/v1/completions", json={"prompt": [[1000, 1001], long_prompt], "max_tokens": 1}), 400)
    # fitting exactly is fine
    ok = client.post(
        "/v1/completions",
        json={"prompt": "one two three", "max_tokens": max_tokens - 1, "stop": ["."], "stop_token_ids": [2]},
    )
    assert ok.status_code == 200


def test_unknown_model_is_404(client: httpx.Client) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        error = assert_error(client.post(path, json={**body, "model": "gpt-9"}), 404, "model")
        assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    assert_error(client.get("/v1/models/gpt-9"), 404)


def test_missing_or_wrong_api_key_is_401(server: BackgroundServer) -> None:
    requests = [
        ("POST", "/v1/completions", {"prompt": "hi"}),
        ("POST", "/v1/chat/completions", {"messages": CHAT}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "hi"}),
    ]
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}, {"Authorization": "Basic x"}):
        with httpx.Client(base_url=server.url, headers=headers) as anonymous:
            for method, path, body in requests:
                error = assert_error(anonymous.request(method, path, json=body), 401)
                assert error["code"] == "invalid_api_key"
            assert anonymous.get("/health").status_code == 200
            assert anonymous.get("/metrics").status_code == 200


def test_openai_client_raises_the_matching_errors(server: BackgroundServer) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    model = oai.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=model, prompt="hi", temperature=-1)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model, messages=[], max_tokens=3)


def test_unknown_routes_and_methods_use_the_error_body(client: httpx.Client) -> None:
    assert_error(client.get("/v1/nothing-here"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_dead_engine_is_503(server: BackgroundServer, client: httpx.Client) -> None:
    engine = server.app.state.graphserve.engine
    engine.dead = True  # what the engine loop sets when it dies
    try:
        assert client.get("/health").status_code == 503
        error = assert_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)
        assert error["code"] == "engine_dead"
        assert_error(client.post("/v1/chat/completions", json={"messages": CHAT}), 503)
        deadline = time.monotonic() + 5
        while not engine_failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine_failures, "the app reports a dead engine (the CLI then exits non-zero)"
    finally:
        engine.dead = False
    assert client.get("/health").status_code == 200


def test_draining_server_refuses_new_requests(server: BackgroundServer, client: httpx.Client) -> None:
    state = server.app.state.graphserve
    state.draining = True  # what SIGTERM sets while running requests finish
    try:
        assert client.get("/health").status_code == 503 and client.get("/health").json()["status"] == "draining"
        error = assert_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)
        assert error["code"] == "shutting_down"
    finally:
        state.draining = False
    assert client.get("/health").status_code == 200


def test_rejected_requests_leave_no_kv_blocks_behind(client: httpx.Client) -> None:
    assert client.post("/v1/completions", json={"prompt": ""}).status_code == 400  # also when run alone
    metrics = client.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line and line[0] != "#"}
    assert values["graphserve_kv_blocks_free"] == values["graphserve_kv_blocks_total"]
    assert values["graphserve_num_requests_running"] == values["graphserve_num_requests_waiting"] == 0
    assert values['graphserve_request_errors_total{status="400"}'] >= 1


def test_engine_that_fails_to_start_keeps_health_503() -> None:
    failures: list[BaseException] = []
    app = create_app(
        AsyncEngine(EngineConfig(model="/nonexistent/model", device="cpu")), on_engine_failure=failures.append
    )
    with BackgroundServer(app) as background, httpx.Client(base_url=background.url) as http:
        for _ in range(200):
            if failures:
                break
            time.sleep(0.05)
        assert failures, "on_startup_failure was called"
        assert http.get("/health").status_code == 503 and http.get("/health").json()["status"] == "failed"
        assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 503)
