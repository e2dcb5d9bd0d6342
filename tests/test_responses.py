"""POST /v1/responses (server/routes_responses.py) through the official `openai` client and raw
HTTP, on one live server of the tiny thinking model (tests/tiny_models.make_thinking_model), whose
reasoning parser comes from its chat template: text input, instructions, a json_schema format and
a function tool (its call made after the thinking, which the call's grammar would forbid, then its
result sent back); the event stream in OpenAI's order, its deltas adding up to the final items and
its response.completed equal to the plain response; every body checked against the openai
package's own types; and the 400s for what a stateless server cannot honour."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a dev extra) validates the outputs")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming
from pydantic import TypeAdapter

from graphserve import AsyncEngine, EngineConfig
from graphserve.server.app import create_app
from live_server import BackgroundServer
from tiny_models import make_thinking_model

THINKING, ANSWER = "\nLet me think", "\n\nThe answer is 42"  # the model's greedy output (tiny_models.THINK_CHAIN)
YES_NO = {"type": "object", "properties": {"ok": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["ok"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                "parameters": WEATHER}
EVENTS = TypeAdapter(ResponseStreamEvent)
CREATE_PARAMS = TypeAdapter(ResponseCreateParamsNonStreaming)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[BackgroundServer]:
    path = make_thinking_model(tmp_path_factory.mktemp("responses") / "m", "qwen3")
    config = EngineConfig(model=str(path), device="cpu", max_num_seqs=4, decode_chunk=2, max_model_len=1024,
                          kv_cache_bytes=16 * 1024**2, warm_up=False)
    with BackgroundServer(create_app(AsyncEngine(config))) as background:  # no parser named: "auto"
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def create(server: BackgroundServer, **params: Any) -> dict:
    """A non-streamed response's JSON: the request body is valid as the client's own
    ResponseCreateParams, the response body validates as its Response."""
    body = {"model": "m", "temperature": 0, **params}
    CREATE_PARAMS.validate_python(body)
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    Response.model_validate(reply.json())
    return reply.json()


def stream_events(server: BackgroundServer, **params: Any) -> list[dict]:
    """The streamed events' JSON, each validated by the client's event union."""
    body = {"model": "m", "temperature": 0, "stream": True, **params}
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in reply.iter_lines():
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                event = json.loads(line.removeprefix("data:"))
                assert event["type"] == name  # the SSE event name is the event's type, as OpenAI sends it
                EVENTS.validate_python(event)
                events.append(event)
    return events


def items(response: dict) -> dict[str, dict]:
    return {item["type"]: item for item in response["output"]}


def text_of(item: dict) -> str:
    return "".join(part["text"] for part in item["content"])


def chat_prompt_tokens(client: openai.OpenAI, messages: list[dict], **kw: Any) -> int:
    """The prompt tokens chat counts for the same conversation."""
    return client.chat.completions.create(model="m", messages=messages, max_tokens=1, **kw).usage.prompt_tokens


def test_text_input_thinking_then_answer(server, client):
    """The reasoning parser came from the chat template (none was named); the thinking is a reasoning
    item, the answer a message, usage counts both and the reasoning tokens."""
    assert server.app.state.graphserve.reasoning_parser == "qwen3"
    r = create(server, input="Hi", max_output_tokens=32, metadata={"run": "1"}, store=False)
    assert [item["type"] for item in r["output"]] == ["reasoning", "message"]
    reasoning, message = items(r)["reasoning"], items(r)["message"]
    assert (text_of(reasoning), reasoning["summary"], text_of(message)) == (THINKING, [], ANSWER)
    assert (r["status"], r["object"], r["metadata"], message["status"]) == ("completed", "response", {"run": "1"},
                                                                            "completed")
    usage = r["usage"]
    assert (usage["output_tokens"], usage["output_tokens_details"]["reasoning_tokens"]) == (12, 4)
    assert usage["input_tokens"] == chat_prompt_tokens(client, [{"role": "user", "content": "Hi"}])
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # the openai client reads it as it reads OpenAI's
    parsed = client.responses.create(model="m", input="Hi", temperature=0, max_output_tokens=32)
    assert parsed.output_text == ANSWER
    assert parsed.output[0].content[0].text == THINKING


def test_instructions_are_the_system_message(server, client):
    r = create(server, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
               instructions="Answer briefly.", max_output_tokens=32)
    assert r["instructions"] == "Answer briefly."
    expected = chat_prompt_tokens(client, [{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": "Hi"}])
    assert r["usage"]["input_tokens"] == expected > create(server, input="Hi", max_output_tokens=1)["usage"][
        "input_tokens"]


def test_json_schema_answer_after_free_thinking(server):
    """The schema constrains only the answer: the thinking (text it forbids) stays free, the answer
    parses and validates."""
    fmt = {"type": "json_schema", "name": "yes_no", "schema": YES_NO, "strict": True}
    r = create(server, input="Is it?", text={"format": fmt}, max_output_tokens=64)
    assert r["status"] == "completed" and r["text"]["format"]["name"] == "yes_no"
    assert text_of(items(r)["reasoning"]) == THINKING
    jsonschema.validate(json.loads(text_of(items(r)["message"])), YES_NO)


def test_function_call_after_thinking_then_its_output_sent_back(server, client):
    """A named tool_choice's grammar forbids any text before the call: with the reasoning parser it
    starts only after the thinking, and the call's arguments validate. Sending the call and its
    output back (the client's usual `input + response.output`) renders the same prompt as chat's
    tool_calls and tool message, and the model answers."""
    choice = {"type": "function", "name": "get_weather"}
    r = create(server, input="Weather in Paris?", tools=[WEATHER_TOOL], tool_choice=choice, max_output_tokens=160)
    assert [item["type"] for item in r["output"]] == ["reasoning", "function_call"]
    assert text_of(items(r)["reasoning"]) == THINKING
    call = items(r)["function_call"]
    assert (call["name"], call["status"], r["status"]) == ("get_weather", "completed", "completed")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)

    history = [{"role": "user", "content": "Weather in Paris?"}, *r["output"],
               {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
    answer = create(server, input=history, tools=[WEATHER_TOOL], max_output_tokens=32)
    assert answer["output"][-1]["type"] == "message" and text_of(answer["output"][-1]) == ANSWER
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}]
    assert answer["usage"]["input_tokens"] == chat_prompt_tokens(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["call_id"], "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"}], tools=chat_tools)
    # the openai client's own objects, dumped whole (null fields included), are accepted back too,
    parsed = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER_TOOL], tool_choice=choice,
                                     temperature=0, max_output_tokens=160)
    again = client.responses.create(model="m", input=[{"role": "user", "content": "Weather in Paris?"},
                                                      *[item.model_dump() for item in parsed.output],
                                                      {"type": "function_call_output", "call_id": parsed.output[-1].call_id,
                                                       "output": "sunny"}],
                                    tools=[WEATHER_TOOL], temperature=0, max_output_tokens=32)
    assert again.output_text == ANSWER
    # or as they are (the client serializes them)
    history = [{"role": "user", "content": "Weather in Paris?"}, *parsed.output,
               {"type": "function_call_output", "call_id": parsed.output[-1].call_id, "output": "sunny"}]
    assert client.responses.create(model="m", input=history, tools=[WEATHER_TOOL], temperature=0,
                                   max_output_tokens=32).output_text == ANSWER


# one letter per event type: the Responses stream's order as a regular expression
_LETTERS = {"response.created": "C", "response.in_progress": "I", "response.output_item.added": "A",
            "response.content_part.added": "P", "response.output_text.delta": "T", "response.output_text.done": "t",
            "response.reasoning_text.delta": "R", "response.reasoning_text.done": "r",
            "response.content_part.done": "p", "response.function_call_arguments.delta": "F",
            "response.function_call_arguments.done": "f", "response.output_item.done": "D",
            "response.completed": "Z", "response.incomplete": "X"}
_ORDER = re.compile(r"CI(?:AP(?:T+t|R+r)pD|AF+fD)*[ZX]")


def _normalized(response: dict) -> dict:
    """A response without what differs between two runs of one request: ids, time, and the prompt
    tokens the prefix cache served (whether an earlier run's blocks are cached yet)."""
    drop = {"id", "created_at", "call_id"}
    usage = {**response["usage"], "input_tokens_details": None}
    return {k: v for k, v in response.items() if k not in drop} | {
        "output": [{k: v for k, v in item.items() if k not in drop} for item in response["output"]], "usage": usage}


@pytest.mark.parametrize("params", [
    dict(input="Hi", max_output_tokens=32),
    dict(input="Is it?", text={"format": {"type": "json_schema", "name": "yes_no", "schema": YES_NO}},
         max_output_tokens=64),
    dict(input="Weather in Paris?", tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"},
         max_output_tokens=160),
    dict(input="Hi", max_output_tokens=3),  # cut inside the thinking: response.incomplete
], ids=["text", "json_schema", "function_call", "incomplete"])
def test_stream_events_in_order_and_equal_to_the_plain_response(server, client, params):
    events = stream_events(server, **params)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert _ORDER.fullmatch("".join(_LETTERS[e["type"]] for e in events)), [e["type"] for e in events]
    final = events[-1]["response"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    # each item: its deltas add up to its done text, which is the final item's
    for index, item in enumerate(final["output"]):
        mine = [e for e in events if e.get("output_index") == index]
        assert mine[0]["item"]["id"] == item["id"] == mine[-1]["item"]["id"] and mine[-1]["item"] == item
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        done = next(e for e in mine if e["type"].endswith(("text.done", "arguments.done")))
        assert deltas == done.get("text", done.get("arguments")) == (
            item["arguments"] if item["type"] == "function_call" else text_of(item))
    assert _normalized(final) == _normalized(create(server, **params))
    # the openai client iterates the same events, and its stream helper, which rebuilds the response
    # from them, ends with the same one (it wants response.completed: an incomplete one raises, as OpenAI's)
    streamed = list(client.responses.create(model="m", temperature=0, stream=True, **params))
    assert [e.type for e in streamed] == [e["type"] for e in events]
    if final["status"] != "completed":
        return
    with client.responses.stream(model="m", temperature=0, **params) as stream:
        rebuilt = stream.get_final_response().model_dump(mode="json", by_alias=True, exclude_unset=True)
    for item in rebuilt["output"]:  # the helper's parse of each text (null: no text_format given)
        for part in item.get("content", []):
            assert part.pop("parsed", None) is None
        assert item.pop("parsed_arguments", None) is None
    assert _normalized(rebuilt) == _normalized(final)


def test_cut_output_is_incomplete(server):
    r = create(server, input="Hi", max_output_tokens=3)
    assert (r["status"], r["incomplete_details"], r["output"][0]["status"]) == (
        "incomplete", {"reason": "max_output_tokens"}, "incomplete")
    assert text_of(r["output"][0]) == "\nLet" and len(r["output"]) == 1


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": [WEATHER_TOOL, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.1"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"bogus": 1}, "bogus"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"max_output_tokens": 10**12}, "max_output_tokens"),
    ({"max_output_tokens": 1010}, "max_output_tokens"),  # past the context (1024) with the prompt
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_or_bad_fields_are_400_naming_the_field(server, extra, param):
    reply = httpx.post(server.url + "/v1/responses", json={"model": "m", "input": "Hi", **extra}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert param.split(".")[0] in error["message"]


def test_store_is_accepted_and_nothing_is_kept(client):
    """store (OpenAI's default true) is accepted as vLLM accepts it: the response is not kept, so a
    later previous_response_id is a 400 saying so."""
    r = client.responses.create(model="m", input="Hi", temperature=0, max_output_tokens=32, store=True,
                                reasoning={"effort": "low"})
    assert r.output_text == ANSWER
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="And then?", previous_response_id=r.id, max_output_tokens=8)
    assert err.value.body["param"] == "previous_response_id" and "stateless" in err.value.body["message"]
