"""What clients depend on in how the server reads a request (server/protocol.py,
server/request_body.py, server/admission.py), through the real server on loopback with the
embedded model on CPU:

- the limits are exact: a body of exactly --max-body-bytes is served and one byte more is a
  413, whether it declares its length or comes chunked; the queue takes exactly
  --max-queue-len engine requests, from the first request on and while others run, and the
  next one is a 429 with Retry-After; a request that can never be served is a 400 naming its
  field even then, never a 429 that clients would retry;
- the caps sit at their published values (OpenAI's n <= 128, 128 tools, 2048 prompts; the
  server's 128 past tool calls and 4096 messages): at the cap a request is not refused for
  it, one past it is a 400 naming the field;
- the boundary values of every range are served, values just outside name the field the
  client sent (top_logprobs, max_completion_tokens, a max_tokens that max_completion_tokens
  overrides), prompt shapes other than the four OpenAI ones are 400s, an empty choice list is a
  400; every numeric range /openapi.json publishes is the one enforced, to the last value;
- the defaults: completions stop at 16 tokens, no echo, no token ids, no usage chunk in a
  stream unless asked, the stop string cut from the text, special tokens left out, the end
  of sequence honoured from the first token, parallel tool calls allowed; chat's
  max_completion_tokens over max_tokens, its prompt being the messages' text with the
  assistant's header (as /tokenize counts it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from test_server_errors import assert_error  # noqa: E402

from graphserve import AsyncEngine, EngineConfig  # noqa: E402
from graphserve.server.app import create_app  # noqa: E402
from live_server import BackgroundServer  # noqa: E402

MAX_MODEL_LEN = 256
QUEUE_LEN = 160  # past OpenAI's n cap of 128, so that n alone meets the protocol's cap first
BODY_LIMIT = 256 * 1024  # room for 4097 chat messages
EOS = 2  # the embedded model's <|im_end|>
IM_START = 1  # a special token that is not an end of sequence
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Hi"}]
# the caps a client can rely on: OpenAI's (n, tools, prompts) and the server's own, in /openapi.json
OPENAI_MAX_N = 128
OPENAI_MAX_TOOLS = 128
OPENAI_MAX_PROMPTS = 2048
SERVER_MAX_TOOL_CALLS = 128
SERVER_MAX_CHAT_MESSAGES = 4096


def engine(max_num_seqs: int, max_model_len: int = MAX_MODEL_LEN) -> AsyncEngine:
    config = EngineConfig(model=None, device="cpu", max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          kv_cache_bytes=32 * 1024**2)
    return AsyncEngine(config)


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    app = create_app(engine(8), max_queue_len=QUEUE_LEN, max_body_bytes=BODY_LIMIT)
    with BackgroundServer(app) as background:
        background.wait_ready()
        yield background


def completion(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert response.status_code == 200, (body, response.text)
    return response.json()


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": CHAT, **body})
    assert response.status_code == 200, (body, response.text)
    return response.json()


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a finished stream, up to [DONE]."""
    assert response.status_code == 200, response.text
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- limits ------------------------------------------------------------------------------------


def sized_body(size: int) -> bytes:
    """A valid completions body of exactly `size` bytes."""
    head, tail = b'{"prompt": "Hi", "max_tokens": 1', b"}"
    return head + b" " * (size - len(head) - len(tail)) + tail


def in_pieces(body: bytes, piece: int = 4096) -> Iterator[bytes]:
    """The body with no Content-Length (chunked): counted as it arrives."""
    for start in range(0, len(body), piece):
        yield body[start : start + piece]


def test_a_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413(client: httpx.Client) -> None:
    assert client.post("/v1/completions", content=sized_body(BODY_LIMIT)).status_code == 200
    error = assert_error(client.post("/v1/completions", content=sized_body(BODY_LIMIT + 1)), 413)
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]
    chunked = client.post("/v1/completions", content=in_pieces(sized_body(BODY_LIMIT)))
    assert chunked.status_code == 200, chunked.text
    error = assert_error(client.post("/v1/completions", content=in_pieces(sized_body(BODY_LIMIT + 1))), 413)
    assert error["code"] == "request_too_large"
    small_chunked = client.post("/v1/completions", content=in_pieces(b'{"prompt": "Hi", "max_tokens": 1}', 7))
    assert small_chunked.status_code == 200, small_chunked.text


# Out of range, or past a cap, as a client may send them: each can never be served, so even a full
# server answers 400 naming the field, never 429 (which clients retry: the openai client raises
# RateLimitError after its retries instead of BadRequestError).
NEVER_SERVED = [
    ("/v1/completions", {"temperature": -0.5}, "temperature"),
    ("/v1/completions", {"top_p": -0.5}, "top_p"),
    ("/v1/completions", {"top_p": 1.5}, "top_p"),
    ("/v1/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"min_p": -0.5}, "min_p"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"presence_penalty": -2.5}, "presence_penalty"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": -0.5}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [1] * 257}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [10**6]}, "stop_token_ids"),  # past the vocabulary
    ("/v1/completions", {"logit_bias": {str(10**6): 1}}, "logit_bias"),
    ("/v1/completions", {"stop": ["x"] * 65}, "stop"),
    ("/v1/completions", {"stop": ["x" * 513]}, "stop"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("/v1/completions", {"structured_outputs": {"json_": {"type": "object"}}}, "structured_outputs.json_"),
    ("/v1/completions", {"prompt": [["a"]]}, "prompt"),
    ("/v1/completions", {"prompt": [[1000, True]]}, "prompt"),
    ("/v1/chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {"stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),  # without tools
]


def test_the_queue_takes_exactly_max_queue_len_and_a_full_server_still_names_a_bad_field() -> None:
    """One request running (max_num_seqs 1), the queue of 4 filled by a fresh server's first
    request (n = 4, admitted at the cap) less its running choice, then one more: the queue is
    full, the next request is a 429 with Retry-After, and a request that can never be served
    is still a 400 naming its field."""
    app = create_app(engine(1, max_model_len=512), max_queue_len=4)
    with BackgroundServer(app) as background, httpx.Client(base_url=background.url, timeout=60.0) as http:
        background.wait_ready()
        long = {"prompt": [1000], "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}

        def assert_full() -> None:
            with http.stream("POST", "/v1/completions", json=long) as full:
                assert full.status_code == 429, "admitted past the queue's length"
                full.read()
            error = assert_error(full, 429)
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            assert full.headers["retry-after"] == "1"

        with http.stream("POST", "/v1/completions", json={**long, "n": 4}) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept open: a dropped generator would close the stream (an abort)
            assert next(line for line in lines if line.startswith("data: "))  # choice 0 runs; 3 wait
            with http.stream("POST", "/v1/completions", json=long) as fourth:
                assert fourth.status_code == 200  # 3 + 1 waiting: the queue is full, not past it
                assert_full()
                for path, body, param in NEVER_SERVED:
                    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": CHAT}
                    error = assert_error(http.post(path, json={**base, "max_tokens": 1, **body}), 400)
                    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error
                oai = openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0)
                with pytest.raises(openai.BadRequestError) as bad:
                    oai.completions.create(model=http.get("/v1/models").json()["data"][0]["id"], prompt="Hi",
                                           max_tokens=1, extra_body={"top_k": -2})
                assert bad.value.param == "top_k"
                assert_full()  # choice 0 still runs: the checks above met a full queue


# ---- caps at their published values ------------------------------------------------------------


def tools(count: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}
            for i in range(count)]


def past_calls(count: int) -> list[dict[str, Any]]:
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "tool_0", "arguments": "{}"}}
             for i in range(count)]
    return [CHAT[0], {"role": "assistant", "content": None, "tool_calls": calls}, {"role": "user", "content": "Ok"}]


def not_refused_for_the_cap(response: httpx.Response, param: str) -> None:
    """Served, or refused for something else (here the context length, or the queue's size)."""
    if response.status_code != 200:
        error = assert_error(response, 400)
        assert error["code"] == "context_length_exceeded" or error["param"] != param, error


def test_caps_sit_at_their_published_values(client: httpx.Client) -> None:
    at_cap = client.post("/v1/completions", json={"prompt": [1000], "max_tokens": 1, "n": OPENAI_MAX_N})
    assert at_cap.status_code == 200 and len(at_cap.json()["choices"]) == OPENAI_MAX_N, at_cap.text
    past_n = client.post("/v1/completions", json={"prompt": [1000], "max_tokens": 1, "n": OPENAI_MAX_N + 1})
    error = assert_error(past_n, 400, "n")
    assert str(OPENAI_MAX_N) in error["message"]

    body = {"messages": CHAT, "max_tokens": 1, "tool_choice": "none"}
    not_refused_for_the_cap(client.post("/v1/chat/completions", json={**body, "tools": tools(OPENAI_MAX_TOOLS)}),
                            "tools")
    error = assert_error(client.post("/v1/chat/completions", json={**body, "tools": tools(OPENAI_MAX_TOOLS + 1)}),
                         400, "tools")
    assert error["code"] is None and str(OPENAI_MAX_TOOLS) in error["message"]

    body = {"max_tokens": 1, "tools": tools(1)}
    param = "messages.1.tool_calls"
    calls = client.post("/v1/chat/completions", json={**body, "messages": past_calls(SERVER_MAX_TOOL_CALLS)})
    not_refused_for_the_cap(calls, param)
    past_cap = client.post("/v1/chat/completions", json={**body, "messages": past_calls(SERVER_MAX_TOOL_CALLS + 1)})
    error = assert_error(past_cap, 400, param)
    assert str(SERVER_MAX_TOOL_CALLS) in error["message"]

    messages = [{"role": "user", "content": ""}] * SERVER_MAX_CHAT_MESSAGES
    not_refused_for_the_cap(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}),
                            "messages")
    error = assert_error(client.post("/v1/chat/completions", json={"messages": [*messages, CHAT[0]], "max_tokens": 1}),
                         400, "messages")
    assert error["code"] is None and str(SERVER_MAX_CHAT_MESSAGES) in error["message"]

    # 2048 prompts are more generations than this server queues (a 400 for n), not too many prompts
    prompts = client.post("/v1/completions", json={"prompt": ["a"] * OPENAI_MAX_PROMPTS, "max_tokens": 1})
    assert assert_error(prompts, 400)["param"] == "n"
    error = assert_error(client.post("/v1/completions", json={"prompt": ["a"] * (OPENAI_MAX_PROMPTS + 1)}), 400,
                         "prompt")
    assert str(OPENAI_MAX_PROMPTS) in error["message"]


# ---- ranges and shapes ---------------------------------------------------------------------------


VALID_EDGES = [
    {"temperature": 0}, {"top_p": 1}, {"top_p": 0.5}, {"top_k": -1}, {"top_k": 0}, {"min_p": 0}, {"min_p": 1},
    {"min_p": 0.5}, {"presence_penalty": -2}, {"presence_penalty": 2}, {"frequency_penalty": -2},
    {"frequency_penalty": 2}, {"repetition_penalty": 0.5}, {"repetition_penalty": 100}, {"min_tokens": 0}, {"n": 1},
    {"stop_token_ids": [0]}, {"logit_bias": {"5": -100, "6": 100}}, {"stop": "z" * 100},
    {"stop": ["z" * 100]}, {"seed": 0},
]


@pytest.mark.parametrize("edge", VALID_EDGES, ids=[str(e) for e in VALID_EDGES])
def test_the_edges_of_every_range_are_served(client: httpx.Client, edge: dict[str, Any]) -> None:
    completion(client, max_tokens=1, **edge)  # chat takes the same fields (_SamplingFields)


def test_logprobs_zero_and_prompt_scoring_are_served(client: httpx.Client) -> None:
    # logprobs 0: the chosen token's logprob only
    logprobs = completion(client, max_tokens=2, logprobs=0)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 2
    content = chat(client, max_tokens=2, logprobs=True, top_logprobs=0)["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(entry["top_logprobs"] == [] for entry in content)
    # max_tokens 0 with echo: the prompt scored, nothing generated
    scored = completion(client, max_tokens=0, echo=True, logprobs=0)
    assert scored["choices"][0]["text"] == PROMPT and scored["usage"]["completion_tokens"] == 0


def test_values_just_outside_name_the_field_the_client_sent(client: httpx.Client) -> None:
    for body, param in (
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": -1, "max_completion_tokens": 2}, "max_tokens"),  # checked though the other one wins
    ):
        assert_error(client.post("/v1/chat/completions", json={"messages": CHAT, **body}), 400, param)


# the token counts also meet the context's rules (0 only with echo, no more than fits), checked above;
# seed's bounds (+-2**63) are past a float's exact integers, and FastAPI writes every bound as a float
# (its range is tested in test_sampling_params.py)
NOT_BY_SCHEMA = {"max_tokens", "max_completion_tokens", "seed"}
ROUTES = {"/v1/completions": {"prompt": [1000], "max_tokens": 1},
          "/v1/chat/completions": {"messages": CHAT, "max_tokens": 1, "logprobs": True}}


def published_ranges(client: httpx.Client, route: str) -> dict[str, tuple[str, dict[str, float]]]:
    """Each numeric field of the route's body in /openapi.json: its type and its bounds."""
    body = client.get("/openapi.json").json()["paths"][route]["post"]["requestBody"]
    ranges = {}
    for name, prop in body["content"]["application/json"]["schema"]["properties"].items():
        for option in prop.get("anyOf", [prop]):
            bounds = {k: option[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
                      if k in option}
            if bounds and option.get("type") in ("integer", "number"):
                ranges[name] = (option["type"], bounds)
    return ranges


def just_past(kind: str, bound: str, value: float) -> float:
    step = -1 if bound == "minimum" else 1
    if kind == "integer":
        return int(value) + step
    return math.nextafter(value, step * math.inf)


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_published_range_is_the_one_the_server_enforces(client: httpx.Client, route: str) -> None:
    """A client generated from /openapi.json sends what the schema allows: each inclusive bound is
    served, and the value just past it (or an exclusive bound itself) is a 400 naming the field."""
    base = ROUTES[route]
    ranges = published_ranges(client, route)
    assert {"temperature", "top_p", "top_k", "min_p", "n", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "min_tokens", "logprobs" if route == "/v1/completions" else "top_logprobs"
            } <= set(ranges), ranges
    for name, (kind, bounds) in ranges.items():
        if name in NOT_BY_SCHEMA:
            continue
        for bound, value in bounds.items():
            value = int(value) if kind == "integer" else value
            if bound.startswith("exclusive"):
                refused = value
            else:
                response = client.post(route, json={**base, name: value})
                assert response.status_code == 200, (name, value, response.text)
                refused = just_past(kind, bound, value)
            assert_error(client.post(route, json={**base, name: refused}), 400, name)


def test_prompts_other_than_the_four_openai_shapes_are_400(client: httpx.Client) -> None:
    batch = completion(client, prompt=[[1000], [1001, 1002]], max_tokens=1)
    assert [c["index"] for c in batch["choices"]] == [0, 1] and batch["usage"]["prompt_tokens"] == 3
    for prompt in ([["a"]], [[1000, True]], [True], [[1000], "a"], ["a", [1000]]):
        assert_error(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), 400, "prompt")


def test_a_choice_list_needs_a_choice(client: httpx.Client) -> None:
    assert completion(client, max_tokens=3, temperature=0, guided_choice=["yes"])["choices"][0]["text"] == "yes"
    out = completion(client, max_tokens=3, temperature=0, structured_outputs={"choice": ["yes"]})
    assert out["choices"][0]["text"] == "yes"
    assert_error(client.post("/v1/completions", json={"prompt": PROMPT, "guided_choice": []}), 400, "guided_choice")
    assert_error(client.post("/v1/completions", json={"prompt": PROMPT, "structured_outputs": {"choice": []}}), 400,
                 "structured_outputs.choice")


# ---- defaults ------------------------------------------------------------------------------------


def test_completions_default_to_16_tokens_without_echo_or_token_ids(client: httpx.Client) -> None:
    body = completion(client, ignore_eos=True, temperature=0)
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 16 and choice["finish_reason"] == "length"
    assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    echoed = completion(client, max_tokens=2, echo=True)["choices"][0]
    assert echoed["text"].startswith(PROMPT)
    with_ids = completion(client, max_tokens=2, return_token_ids=True)
    choice = with_ids["choices"][0]
    assert len(choice["token_ids"]) == 2 and len(choice["prompt_token_ids"]) == with_ids["usage"]["prompt_tokens"]
    assert "token_strs" not in client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()["token_strs"]


def test_chat_responses_carry_no_tool_calls_logprobs_or_ids_unless_asked(client: httpx.Client) -> None:
    body = chat(client, max_tokens=2)
    choice = body["choices"][0]
    assert set(choice["message"]) == {"role", "content"} and choice["logprobs"] is None
    assert "token_ids" not in choice and "prompt_token_ids" not in body
    with_ids = chat(client, max_tokens=2, return_token_ids=True)
    assert len(with_ids["choices"][0]["token_ids"]) == 2
    assert len(with_ids["prompt_token_ids"]) == with_ids["usage"]["prompt_tokens"]


def test_the_end_of_sequence_ends_the_output_from_the_first_token(client: httpx.Client) -> None:
    """min_tokens defaults to 0 and ignore_eos to false: an end of sequence drawn first ends the choice."""
    for route in (completion, chat):
        ended = route(client, max_tokens=8, logit_bias={str(EOS): 100})
        choice = ended["choices"][0]
        assert choice["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] == 1
        assert (choice["text"] if route is completion else choice["message"]["content"]) == ""
        ignored = route(client, max_tokens=8, logit_bias={str(EOS): 100}, ignore_eos=True)
        assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 8


def test_special_tokens_are_left_out_of_the_text_unless_asked(client: httpx.Client) -> None:
    body = {"max_tokens": 3, "logit_bias": {str(IM_START): 100}}
    assert completion(client, **body)["choices"][0]["text"] == ""
    shown = completion(client, **body, skip_special_tokens=False)["choices"][0]["text"]
    assert shown == "<|im_start|>" * 3


def test_the_stop_string_is_cut_from_the_text_unless_asked(client: httpx.Client) -> None:
    text = completion(client, max_tokens=8, temperature=0)["choices"][0]["text"]
    stop = text.split()[1]  # " Paris.\n\nThe ..." -> a word inside the output
    head = text[: text.index(stop)]
    choice = completion(client, max_tokens=8, temperature=0, stop=[stop])["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (head, "stop", stop)
    kept = completion(client, max_tokens=8, temperature=0, stop=stop, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == head + stop


@pytest.mark.parametrize("route,body", [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions",
                                                                                  {"messages": CHAT})])
def test_a_stream_carries_usage_only_when_asked(client: httpx.Client, route: str, body: dict[str, Any]) -> None:
    base = {**body, "max_tokens": 3, "stream": True, "ignore_eos": True}
    for options in ({}, {"stream_options": {}}, {"stream_options": {"include_usage": False}}):
        chunks = events(client.post(route, json={**base, **options}))
        assert chunks and all(chunk.get("usage") is None for chunk in chunks), chunks
    chunks = events(client.post(route, json={**base, "stream_options": {"include_usage": True}}))
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert all(chunk.get("usage") is None for chunk in chunks[:-1])


def test_chat_max_completion_tokens_wins_over_max_tokens(client: httpx.Client) -> None:
    for limits, expected in (({"max_tokens": 3}, 3), ({"max_completion_tokens": 2, "max_tokens": 5}, 2),
                             ({"max_completion_tokens": 4}, 4)):
        body = chat(client, ignore_eos=True, **limits)
        assert body["usage"]["completion_tokens"] == expected, (limits, body["usage"])
        assert body["choices"][0]["finish_reason"] == "length"


def test_the_chat_prompt_is_the_messages_text_with_the_assistants_header(client: httpx.Client) -> None:
    def prompt_tokens(messages: list[dict[str, Any]]) -> int:
        return chat(client, messages=messages, max_tokens=1)["usage"]["prompt_tokens"]

    text = "Name three rivers in Europe, please."
    as_string = prompt_tokens([{"role": "user", "content": text}])
    as_parts = prompt_tokens([{"role": "user", "content": [{"type": "text", "text": text}]}])
    assert as_string == as_parts > prompt_tokens(CHAT)
    counted = client.post("/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()["count"]
    assert counted == as_string
    without_header = client.post("/tokenize", json={"messages": [{"role": "user", "content": text}],
                                                    "add_generation_prompt": False}).json()["count"]
    assert without_header < counted
    continued = chat(client, messages=[{"role": "user", "content": text}], max_tokens=1, add_generation_prompt=False)
    assert continued["usage"]["prompt_tokens"] == without_header


def test_parallel_tool_calls_by_default_an_answer_may_go_on_after_a_call(client: httpx.Client) -> None:
    """OpenAI's default parallel_tool_calls=true: the first call does not end the answer (here
    the model writes on after it until max_tokens); with parallel_tool_calls=false the grammar
    ends it at its one call (35 tokens, finish_reason "tool_calls")."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = {"messages": [{"role": "user", "content": "What's the weather in Paris and in London?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}],
            "tool_choice": "required", "temperature": 0, "max_tokens": 40}
    choice = chat(client, **body)["choices"][0]
    call = choice["message"]["tool_calls"][0]["function"]
    # the arguments as parsed values: their whitespace is the quantized model's pick, which differs by CPU
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "length", choice  # went on after the call, up to max_tokens
