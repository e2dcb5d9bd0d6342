"""What a user sees, through the real server on loopback (the embedded model on CPU, httpx and
the official `openai` client): what presence_penalty, logit_bias, min_tokens and the top-k/top-p/min-p
filters do to the output, the caps on tools
and past tool calls as 400s naming the field, and a tool call cut off by max_tokens ending
in "length", whole and streamed."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve import AsyncEngine, EngineConfig
from graphserve.server.app import create_app
from graphserve.server.protocol import MAX_TOOL_CALLS, MAX_TOOLS
from live_server import BackgroundServer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                         "parameters": WEATHER}}
PENALTY_PROMPTS = ["The capital of France is", "My favourite food is"]  # greedy repeats itself on both
QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    config = EngineConfig(model=None, device="cpu", dtype="float32", max_num_seqs=8, decode_chunk=4, max_model_len=1024,
                          kv_cache_bytes=64 * 1024**2)
    with BackgroundServer(create_app(AsyncEngine(config))) as background:
        background.wait_ready()
        yield background


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error body of a 400."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error


# ---- sampling controls ----------------------------------------------------------------------


def distinct_tokens(client: httpx.Client, penalty: float | None) -> list[int]:
    """Per prompt, how many different tokens greedy decoding emits in 16 tokens."""
    body = {"prompt": PENALTY_PROMPTS, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    response = client.post("/v1/completions", json=body | ({} if penalty is None else {"presence_penalty": penalty}))
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert [len(c["token_ids"]) for c in choices] == [16] * len(PENALTY_PROMPTS)
    return [len(set(c["token_ids"])) for c in choices]


def test_presence_penalty_discourages_repeats_and_a_negative_one_encourages_them(client: httpx.Client) -> None:
    """A positive presence_penalty lowers every token already generated, so greedy output
    repeats itself less (more different tokens); a negative one raises them (fewer); zero
    changes nothing. (The requests run together: greedy output does not depend on its batch.)"""
    with ThreadPoolExecutor(4) as pool:
        plain, penalised, rewarded, zero = pool.map(lambda p: distinct_tokens(client, p), [None, 2.0, -2.0, 0.0])
    assert sum(plain) < 16 * len(PENALTY_PROMPTS)  # precondition: plain greedy repeats tokens
    for more, fewer in ((penalised, plain), (plain, rewarded)):
        assert all(m > f for m, f in zip(more, fewer)), (penalised, plain, rewarded)
    assert zero == plain


def test_logit_bias_reaches_the_first_token_id(client: httpx.Client) -> None:
    """A bias applies to every id of the vocabulary, 0 included: +100 forces it, -100 bans it."""
    body = {"prompt": PENALTY_PROMPTS[0], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    forced = client.post("/v1/completions", json=body | {"logit_bias": {"0": 100}})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["token_ids"] == [0, 0, 0]
    ahead = client.post("/v1/completions", json=body | {"logit_bias": {"0": 100, "1": 99}})
    banned = client.post("/v1/completions", json=body | {"logit_bias": {"0": -100, "1": 99}})
    assert ahead.json()["choices"][0]["token_ids"] == [0, 0, 0]
    assert banned.json()["choices"][0]["token_ids"] == [1, 1, 1]


def test_each_filter_down_to_one_token_makes_sampling_greedy(client: httpx.Client) -> None:
    """top_k=1, a tiny top_p and min_p=1, each given alone, keep only the most likely token: a
    hot sampled request then gives the greedy output."""
    body = {"prompt": PENALTY_PROMPTS[1], "max_tokens": 12, "ignore_eos": True}

    def text(**params: Any) -> str:
        response = client.post("/v1/completions", json=body | params)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    filters = [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}]
    greedy, hot = text(temperature=0), text(temperature=1.5, seed=7)
    filtered = [text(temperature=1.5, seed=7, **f) for f in filters]  # one at a time: each alone in its batch
    assert hot != greedy  # precondition: unfiltered, this seed draws something else
    assert filtered == [greedy] * len(filters), dict(zip(map(str, filters), filtered))


def test_top_p_draws_only_from_the_nucleus(client: httpx.Client) -> None:
    """With top_p, every drawn token is one of the most likely tokens whose probabilities add
    up to top_p: the tokens ranked above it (logprobs, at temperature 1) hold less than top_p."""
    top_p = 0.5
    response = client.post("/v1/completions", json={"prompt": PENALTY_PROMPTS, "max_tokens": 32, "temperature": 1.0,
                                                    "top_p": top_p, "seed": 3, "logprobs": 20, "ignore_eos": True})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        logprobs = choice["logprobs"]
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
            above = sum(math.exp(v) for v in top.values() if v > logprob)
            assert above < top_p + 1e-4, (token, logprob, top)


EOS = 2  # <|im_end|>, the embedded model's end of sequence


def test_min_tokens_holds_off_the_end_of_sequence(client: httpx.Client) -> None:
    """A request whose model wants to stop at once (the EOS token biased up) gets exactly
    min_tokens tokens before it."""
    body = {"prompt": PENALTY_PROMPTS[0], "max_tokens": 8, "temperature": 0, "logit_bias": {str(EOS): 100},
            "return_token_ids": True}
    greedy = client.post("/v1/completions", json={**body, "logit_bias": {}, "ignore_eos": True}).json()
    for min_tokens in (0, 1, 3):
        response = client.post("/v1/completions", json={**body, "min_tokens": min_tokens})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["token_ids"] == greedy["choices"][0]["token_ids"][:min_tokens] + [EOS], min_tokens


# ---- caps on tools and past tool calls ---------------------------------------------------------


def tools(count: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": WEATHER}} for i in range(count)]


def test_more_tools_than_the_cap_is_a_400_naming_tools(client: httpx.Client, model: str) -> None:
    body = {"model": model, "messages": QUESTION, "max_tokens": 1, "tool_choice": "none"}
    at_cap = client.post("/v1/chat/completions", json={**body, "tools": tools(MAX_TOOLS)})
    assert at_cap.status_code == 200, at_cap.text
    error = error_of(client.post("/v1/chat/completions", json={**body, "tools": tools(MAX_TOOLS + 1)}))
    assert error["param"] == "tools"
    assert str(MAX_TOOLS) in error["message"]


def past_calls(count: int) -> list[dict]:
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
             for i in range(count)]
    return [QUESTION[0], {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "user", "content": "Thanks."}]


def test_more_past_tool_calls_than_the_cap_is_a_400_naming_them(client: httpx.Client, model: str) -> None:
    body = {"model": model, "max_tokens": 1, "tools": [TOOL]}
    error = error_of(client.post("/v1/chat/completions", json={**body, "messages": past_calls(MAX_TOOL_CALLS + 1)}))
    assert error["param"] == "messages.1.tool_calls"
    assert str(MAX_TOOL_CALLS) in error["message"]
    # at the cap the calls are taken: what may still stop them is the context length, not the cap
    at_cap = client.post("/v1/chat/completions", json={**body, "messages": past_calls(MAX_TOOL_CALLS)})
    assert at_cap.status_code == 200 or not (error_of(at_cap)["param"] or "").startswith("messages"), at_cap.text


# ---- a tool call cut off by max_tokens --------------------------------------------------------


def required_call(oai: openai.OpenAI, model: str, max_tokens: int, stream: bool = False) -> Any:
    return oai.chat.completions.create(model=model, messages=QUESTION, tools=[TOOL], tool_choice="required",
                                       max_tokens=max_tokens, temperature=0, stream=stream,
                                       **({"stream_options": {"include_usage": True}} if stream else {}))


def test_a_tool_call_cut_off_by_max_tokens_finishes_with_length(oai: openai.OpenAI, model: str) -> None:
    """tool_choice="required" with max_tokens too small for the whole call: the choice ends in
    "length" (the model did not stop), not "tool_calls"; usage counts max_tokens; the call's
    name and what arrived of its arguments are returned, streamed deltas alike."""
    budget = 21  # the embedded model's call: `<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}`
    cut = required_call(oai, model, budget)
    choice = cut.choices[0]
    assert choice.finish_reason == "length"
    assert cut.usage.completion_tokens == budget
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments.startswith("{")
    with pytest.raises(ValueError):  # precondition: cut inside the arguments
        json.loads(call.function.arguments)

    finishes, names, arguments, usage = [], [], "", None
    for chunk in required_call(oai, model, budget, stream=True):
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
            for delta in c.delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
    assert finishes == ["length"]
    assert usage is not None and usage.completion_tokens == budget
    assert (names, arguments) == (["get_weather"], call.function.arguments)
