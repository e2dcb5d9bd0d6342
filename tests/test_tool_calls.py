"""Tool calling on /v1/chat/completions (server/tools.py) through the official `openai` client:
required, named and auto calls are well-formed calls of a given tool with arguments valid
against its schema; streamed deltas reassemble into the same call; a call, its tool
result and the answer round-trip; the call parser handles both output formats; bad
tool requests are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a dev extra) validates the outputs")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve import AsyncEngine, EngineConfig
from graphserve.engine.tokenizer import Tokenizer
from graphserve.server.app import create_app
from graphserve.server.protocol import ChatCompletionRequest
from live_server import BackgroundServer
from graphserve.server.tools import (FALLBACK, HERMES, LLAMA3_JSON, ToolCallParser, call_format, check_tool_request,
                                     conversation, parse_tool_calls)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                             "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]


def past_call(city: str, i: int) -> list[dict]:
    return [{"role": "user", "content": f"What's the weather in {city}?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": f"call_{i}", "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}]


# three earlier turns that called the tool: the small embedded model then calls it by itself
FEW_SHOT = past_call("Paris", 1) + past_call("Rome", 2) + past_call("Berlin", 3) + [
    {"role": "user", "content": "What's the weather in London?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    config = EngineConfig(model=None, device="cpu", max_num_seqs=8, decode_chunk=4, max_model_len=1024,
                          kv_cache_bytes=64 * 1024**2)
    with BackgroundServer(create_app(AsyncEngine(config))) as background:
        background.wait_ready()
        yield background


def assert_valid_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [None, False], ids=["parallel-default", "one-call"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_required_and_named_calls_are_valid(oai, model, tool_choice, parallel):
    """The first call is the grammar's: a valid call of the tool. After it, OpenAI's default
    parallel_tool_calls lets the model write on (more calls, or text), where and whether it stops being
    its greedy pick, which on the Q4_1 weights differs by CPU: it ends "tool_calls" or runs into
    max_tokens ("length"). With parallel_tool_calls=false the grammar ends the output at its one call."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = oai.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                    max_tokens=80, temperature=0, **extra)
    choice = r.choices[0]
    names = None if tool_choice == "required" else ["get_time"]
    assert_valid_calls(choice.message.tool_calls, names)
    if parallel is False:
        assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls", choice
    elif choice.finish_reason == "length":  # only where the output really ran into max_tokens
        assert r.usage.completion_tokens == 80, r.usage
    else:
        assert choice.finish_reason == "tool_calls", choice


def test_required_sampled_n2(oai, model):
    r = oai.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", n=2,
                                    seed=5, max_tokens=80, temperature=1.0, extra_body={"return_token_ids": True})
    assert len(r.choices) == 2
    for choice in r.choices:
        if choice.finish_reason == "length":  # only when the output really ran into max_tokens
            assert len(choice.model_extra["token_ids"]) == 80
        else:
            assert choice.finish_reason == "tool_calls"
            assert_valid_calls(choice.message.tool_calls)


def test_auto_parses_the_models_own_call(oai, model):
    r = oai.chat.completions.create(model=model, messages=FEW_SHOT, tools=TOOLS, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert_valid_calls(choice.message.tool_calls)
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "London"
    assert choice.finish_reason == "tool_calls" and not choice.message.content


def test_tool_choice_none_and_no_tools_give_plain_text(oai, model):
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        r = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0, **kw)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


# "required" with parallel_tool_calls=false: the grammar, not the model's greedy pick (which differs by CPU
# on the Q4_1 weights), ends the output after its call; in "auto" the model's own call ends it by a wide margin
@pytest.mark.parametrize("messages, tool_choice, extra", [(QUESTION, "required", {"parallel_tool_calls": False}),
                                                          (FEW_SHOT, "auto", {})], ids=["required", "auto"])
def test_streamed_deltas_reassemble_into_the_same_call(oai, model, messages, tool_choice, extra):
    kw = dict(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=80, temperature=0,
              **extra)
    whole = oai.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # a call's first delta: index, id, type and name
                    assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_round_trip_call_result_answer(server, oai, model):
    """The call and the tool's result go back into the model's prompt (in the hermes form of the
    embedded model's template), and it answers in text. Which words it answers with are its greedy
    pick on the Q4_1 weights, which differs by CPU: the prompt it was given is what is checked."""
    first = oai.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer = oai.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=30, temperature=0,
                                         extra_body={"return_token_ids": True})
    message = answer.choices[0].message
    assert message.tool_calls is None and message.content
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": answer.model_extra["prompt_token_ids"]},
                        timeout=60).json()["prompt"]
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>' in prompt
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt  # the tool's result reached the model
    assert prompt.index("</tool_call>") < prompt.index("<tool_response>")


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frog"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
], ids=["unknown-named", "choice-without-tools", "duplicate", "bad-name", "bad-schema", "with-response-format",
        "unknown-choice"])
def test_bad_tool_requests_are_400s(server, model, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": QUESTION, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is not None
    assert error["param"].startswith(param), error


# ---- the parser and the prompt ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt, text", [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}"}]}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'),
], ids=["hermes", "llama3_json"])
def test_parser_fed_piecewise_equals_whole(fmt, text):
    content, calls = parse_tool_calls(fmt, text)
    for size in (1, 2, 5, 13):
        parser = ToolCallParser(fmt)
        for i in range(0, len(text), size):
            parser.feed(text[i:i + size])
        parser.finish()
        assert [(c.name, c.arguments) for c in parser.calls] == [(c.function.name, c.function.arguments) for c in calls]
    for call in calls:
        json.loads(call.function.arguments)
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments)["city"] == "Paris"
    assert [c.function.name for c in calls] == (["get_weather", "get_time"] if fmt is HERMES else ["get_weather"])
    assert content == ("Let me check." if fmt is HERMES else None)


def test_text_after_a_closed_call_is_content_again():
    text = 'Checking. <tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call> Done, see above.'
    for size in (1, 3, len(text)):
        parser = ToolCallParser(HERMES)
        for i in range(0, len(text), size):
            parser.feed(text[i:i + size])
        parser.finish()
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_time", {"city": "Rome"})]
        assert parser.content.startswith("Checking. ") and parser.content.endswith(" Done, see above.")


def test_text_that_only_looks_like_a_call_stays_content():
    assert parse_tool_calls(HERMES, "a <tool and <tool_call> nothing") == ("a <tool and <tool_call> nothing", [])


def test_streamed_text_is_held_back_only_while_it_could_open_a_call():
    """A client streaming with tools sees text as it comes, except a tail that could be the start
    of a call's opening, which comes once it is clear; at the end it is content too."""
    parser = ToolCallParser(HERMES)
    assert parser.feed("Hello") == ("Hello", [])  # no tail of it opens <tool_call>
    assert parser.feed(" world <tool") == (" world ", [])  # "<tool" might
    assert parser.feed("s are") == ("<tools are", [])  # it did not
    assert parser.feed(" fun <tool_ca") == (" fun ", [])
    assert parser.finish() == ("<tool_ca", [])  # the output ended: it was text
    assert parser.content == "Hello world <tools are fun <tool_ca" and parser.calls == []


def test_a_request_without_tools_may_not_call_any():
    assert check_tool_request(ChatCompletionRequest(messages=QUESTION)) is False
    assert check_tool_request(ChatCompletionRequest(messages=QUESTION, tools=TOOLS)) is True
    assert check_tool_request(ChatCompletionRequest(messages=QUESTION, tools=TOOLS, tool_choice="none")) is False


def test_fallback_conversation_keeps_the_system_message_and_text_beside_calls():
    """A template without tool support: the tools' listing joins the client's own system message,
    and an assistant turn with both text and calls keeps its text before the calls; a tool left
    without a description is listed without one (no null)."""
    tools = TOOLS + [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]
    body = ChatCompletionRequest(messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    ], tools=tools)
    messages, none = conversation(body, FALLBACK, with_tools=True)
    assert none is None and len(messages) == 3
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You are terse.\n\n")
    assert "get_weather" in messages[0]["content"]
    assert messages[2]["content"] == ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                      "\n</tool_call>")
    _, native_tools = conversation(body, HERMES, with_tools=True)
    assert native_tools[2]["function"] == {"name": "ping", "parameters": {"type": "object"}}
    assert "null" not in messages[0]["content"]


def test_a_past_call_whose_arguments_are_not_json_is_rendered_as_sent():
    """A client's history may hold a call with arguments that do not parse (a truncated call): the
    template gets them as the client sent them, and the request is served."""
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Par'}}]},
    ], tools=TOOLS)
    messages, _ = conversation(body, HERMES, with_tools=True)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'


def test_llama3_templates_get_the_tools_natively_and_a_conversation_opened_by_the_assistant_keeps_it():
    body = ChatCompletionRequest(messages=[{"role": "assistant", "content": "Hi, ask me."}, *QUESTION], tools=TOOLS)
    _, tools = conversation(body, LLAMA3_JSON, with_tools=True)
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    fallback, _ = conversation(body, FALLBACK, with_tools=True)
    assert [m["role"] for m in fallback] == ["system", "assistant", "user"]
    assert fallback[1]["content"] == "Hi, ask me."


def test_native_templates_render_tools_and_past_calls(tmp_path):
    """A template that knows tools (Qwen2.5-like) gets them as `tools` and calls as `tool_calls`;
    one that does not (the embedded SmolLM2) gets the fallback system prompt and hermes text."""
    template = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><tool_call>\n{% endif %}"
                "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
                "{% endfor %}")
    assert call_format(template) is HERMES
    assert call_format("{{ '<|python_tag|>' }}") is LLAMA3_JSON
    assert call_format(None) is FALLBACK
    body = ChatCompletionRequest(messages=FEW_SHOT[:2] + [{"role": "tool", "tool_call_id": "call_1", "content": "21 C"}],
                                 tools=TOOLS)
    messages, tools = conversation(body, HERMES, with_tools=True)
    assert tools[0]["function"]["name"] == "get_weather"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}
    (tmp_path / "tokenizer.json").write_text(_word_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    rendered = Tokenizer(tmp_path).apply_chat_template(messages, tools=tools)
    assert '"name": "get_weather"' in rendered and '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' \
        in rendered and "[tool]21 C" in rendered
    fallback, none = conversation(body, FALLBACK, with_tools=True)
    assert none is None and fallback[0]["role"] == "system" and "get_weather" in fallback[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in fallback[2]["content"]
    assert fallback[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}


def _word_tokenizer_json() -> str:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    return HFTokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")).to_str()
