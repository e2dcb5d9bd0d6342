"""gpt-oss's harmony format through the real server and the official `openai` client, on a tiny
model that writes harmony (tests/tiny_models.make_harmony_model: a bigram chain whose greedy output
is `<|channel|>analysis<|message|>Let me think<|end|><|start|>assistant<|channel|>final<|message|>The
answer is 42<|return|>`, or where a grammar forbids the answer, a call of get_weather), its parser
(gpt-oss) chosen from its chat template: the thinking and the answer exactly, streamed and not; tool
calls parsed into `tool_calls` (chat) and function_call items (/v1/responses); a json_schema that
constrains only the final channel's message; and the parser alone on harmony's call forms."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a dev extra) validates the outputs")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve import AsyncEngine, EngineConfig
from graphserve.server.app import create_app
from live_server import BackgroundServer
from tiny_models import make_harmony_model

THINKING, ANSWER = "Let me think", "The answer is 42"
CALL_ARGUMENTS = '{"city": "Paris"}'  # the model's call (tiny_models.HARMONY_CALL), as it wrote it
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
YES_NO = {"type": "object", "properties": {"ok": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    path = make_harmony_model(tmp_path_factory.mktemp("harmony") / "m")
    return EngineConfig(model=str(path), device="cpu", max_num_seqs=4, decode_chunk=2, max_model_len=1024,
                        kv_cache_bytes=16 * 1024**2, warm_up=False)


@pytest.fixture(scope="module")
def server(config) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(AsyncEngine(config))) as background:  # no parser named: "auto"
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    assert server.app.state.graphserve.reasoning_parser == "gpt-oss"  # from the chat template
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, stream: bool, **kw: Any) -> dict:
    """One choice's reasoning, content, tool calls (name, arguments), finish_reason and usage, whole or
    reassembled from the stream (whose thinking deltas all come before the answer's)."""
    kw = {"model": "m", "messages": HI, "temperature": 0, "max_tokens": 64, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert m.model_extra.get("reasoning") == m.model_extra.get("reasoning_content")
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert all(c.id.startswith("call_") for c in m.tool_calls or [])
        return dict(reasoning=m.model_extra.get("reasoning_content"), content=m.content, calls=calls,
                    finish=r.choices[0].finish_reason, usage=r.usage.model_dump())
    reasoning, content, finish, usage, order, calls = None, None, None, None, [], {}
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage.model_dump() if chunk.usage else usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            if extra.get("reasoning_content"):
                reasoning = (reasoning or "") + extra["reasoning_content"]
                order.append("r")
            if choice.delta.content:
                content = (content or "") + choice.delta.content
                order.append("c")
            for delta in choice.delta.tool_calls or []:
                order.append("t")
                if delta.id is not None:  # a call opens: its id, type and name come first, once
                    assert delta.index not in calls and delta.type == "function"
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
    assert order == sorted(order, key="rct".index)  # the thinking first, then the answer or the calls
    return dict(reasoning=reasoning, content=content, calls=[tuple(c) for _, c in sorted(calls.items())],
                finish=finish, usage=usage)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_thinking_then_answer(server, client, stream):
    r = chat(client, stream)
    assert (r["reasoning"], r["content"], r["calls"], r["finish"]) == (THINKING, ANSWER, [], "stop")
    # every token of the chain after the prompt, <|return|> included; the thinking's text re-tokenized
    tokenizer = server.app.state.graphserve.engine.tokenizer
    assert r["usage"]["completion_tokens"] == 19
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(tokenizer.encode(THINKING, False))


def test_cut_in_the_thinking_is_all_reasoning(client):
    for stream in (False, True):
        r = chat(client, stream, max_tokens=5)  # <|channel|> analysis <|message|> Let " me"
        assert (r["reasoning"], r["content"], r["finish"]) == ("Let me", None, "length")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_required_call_is_parsed_into_tool_calls(client, tool_choice, stream):
    """The tool grammar (server/harmony_grammar.py) leaves the analysis free and forbids the answer: the
    model calls the tool in harmony's form, parsed into OpenAI's tool_calls, its arguments as written."""
    r = chat(client, stream, tools=TOOLS, tool_choice=tool_choice)
    assert (r["reasoning"], r["content"], r["calls"], r["finish"]) == (
        THINKING, None, [("get_weather", CALL_ARGUMENTS)], "tool_calls")
    jsonschema.validate(json.loads(r["calls"][0][1]), WEATHER)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_lets_the_model_answer(client, stream):
    r = chat(client, stream, tools=TOOLS)
    assert (r["reasoning"], r["content"], r["calls"], r["finish"]) == (THINKING, ANSWER, [], "stop")


def test_a_call_and_its_result_render_as_harmony_messages(server, client):
    """A past call and its result reach the template natively (harmony's messages to and from
    functions.get_weather, not a system prompt describing another format), and the model answers."""
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, temperature=0, max_tokens=64,
                                       extra_body={"return_token_ids": True})
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (ANSWER, None)
    prompt = server.app.state.graphserve.engine.tokenizer.decode(r.model_extra["prompt_token_ids"], False)
    assert prompt.endswith(
        '<|start|>user<|message|>Hi<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json'
        '<|message|>{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
        '<|message|>sunny<|end|><|start|>assistant')
    assert "# Tools\nfunctions.get_weather: " in prompt


def test_json_schema_constrains_only_the_final_message(client):
    """The grammar starts after the final channel's header: the analysis is the model's own text
    (which the schema forbids), the answer parses and validates; streamed, the same."""
    fmt = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}
    whole, streamed = (chat(client, stream, response_format=fmt) for stream in (False, True))
    assert (whole["reasoning"], whole["finish"]) == (THINKING, "stop")
    jsonschema.validate(json.loads(whole["content"]), YES_NO)
    assert {k: streamed[k] for k in ("reasoning", "content", "finish")} == {
        k: whole[k] for k in ("reasoning", "content", "finish")}


def test_responses_reasoning_message_and_function_call_items(client):
    """/v1/responses: the thinking a reasoning item, the answer a message, a required call a function_call
    item; streamed, response.completed holds the same output."""
    r = client.responses.create(model="m", input="Hi", temperature=0, max_output_tokens=64)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == (THINKING, ANSWER)
    r = client.responses.create(model="m", input="Weather in Paris?", temperature=0, max_output_tokens=64,
                                tools=[{"type": "function", **TOOLS[0]["function"]}], tool_choice="required")
    assert [item.type for item in r.output] == ["reasoning", "function_call"]
    call = r.output[1]
    assert (call.name, call.arguments, call.status, r.status) == ("get_weather", CALL_ARGUMENTS, "completed",
                                                                  "completed")
    events = list(client.responses.create(model="m", input="Weather in Paris?", temperature=0, max_output_tokens=64,
                                          tools=[{"type": "function", **TOOLS[0]["function"]}],
                                          tool_choice="required", stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    assert (events[-1].type, deltas) == ("response.completed", CALL_ARGUMENTS)
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in final.output] == [
        ("reasoning", None, None), ("function_call", "get_weather", CALL_ARGUMENTS)]
    assert final.output[0].content[0].text == THINKING


def test_responses_json_schema_format(client):
    fmt = {"type": "json_schema", "name": "yes_no", "schema": YES_NO, "strict": True}
    r = client.responses.create(model="m", input="Is it?", temperature=0, max_output_tokens=64, text={"format": fmt})
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THINKING
    jsonschema.validate(json.loads(r.output_text), YES_NO)


def test_tools_without_the_gpt_oss_parser_are_a_400(config):
    """With the parser off nothing reads harmony's calls: a request with tools is refused, naming the field."""
    with BackgroundServer(create_app(AsyncEngine(config), reasoning_parser="none")) as background:
        background.wait_ready()
        reply = httpx.post(background.url + "/v1/chat/completions", timeout=30,
                           json={"model": "m", "messages": HI, "tools": TOOLS, "max_tokens": 8})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
    assert "--reasoning-parser gpt-oss" in reply.json()["error"]["message"]


# ---- the parser alone ------------------------------------------------------------------------------

CALL_FORMS = [
    # as the harmony guide writes a call, and as gpt-oss's template renders a past one (recipient after the role),
    # also as the output's first message (its role in the prompt)
    '<|channel|>analysis<|message|>Need it<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
    '<|constrain|>json<|message|>{"city": "Rome"}<|call|>',
    '<|channel|>analysis<|message|>Need it<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary '
    'json<|message|>{"city": "Rome"}<|call|>',
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>',
]


@pytest.mark.parametrize("output", CALL_FORMS, ids=["channel-recipient", "role-recipient", "first-message"])
def test_harmony_calls_parsed_as_the_engine_detokenizes_them(tmp_path, output):
    """Token ids detokenized as the engine streams them, a few at a time: one call, its opening delta
    (index, id, type, name) first, its argument fragments adding up to what the model wrote; a call
    to a built-in tool (not functions.) is no function call."""
    from graphserve.engine.detokenizer import IncrementalDetokenizer
    from graphserve.engine.tokenizer import Tokenizer
    from graphserve.server.harmony import HarmonySplitter
    from tiny_models import make_harmony_tokenizer

    tokenizer = Tokenizer(make_harmony_tokenizer(tmp_path / "harmony"))
    ids = tokenizer.encode(output, add_special_tokens=False)
    for size in (1, 2, 5, len(ids)):
        detokenizer, splitter, deltas = IncrementalDetokenizer(tokenizer, False), HarmonySplitter(), []
        for i in range(0, len(ids), size):
            splitter.feed(detokenizer.add(ids[i:i + size]))
            deltas += splitter.take_call_deltas()
        splitter.finish()
        deltas += splitter.take_call_deltas()
        assert splitter.message_fields() == (("Need it", None) if "analysis" in output else (None, None))
        [call] = splitter.calls
        assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Rome"}')
        assert deltas[0] == {"index": 0, "id": call.id, "type": "function",
                             "function": {"name": "get_weather", "arguments": deltas[0]["function"]["arguments"]}}
        assert "".join(d["function"]["arguments"] for d in deltas) == call.function.arguments
    builtin = HarmonySplitter()
    builtin.feed('<|channel|>analysis<|message|>Look<|end|><|start|>assistant<|channel|>commentary '
                 'to=browser.search code<|message|>{"query": "x"}<|call|>')
    assert (builtin.finish(), builtin.calls, builtin.message_fields()) == (("", ""), [], ("Look", None))


JSON_FORMAT = "json_schema"  # a response_format's grammar rather than a tool_choice's


@pytest.mark.parametrize("grammar, output, accepted", [
    # the forms gpt-oss writes: a preamble, the content type without <|constrain|>, the recipient after the role
    ("required", "<|channel|>analysis<|message|>Hm<|end|><|start|>assistant<|channel|>commentary<|message|>Checking."
                 "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>"
                 '{"city": "Rome"}<|call|>', True),
    ("required", ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Rome"}<|call|>',
     True),
    ("required", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>',
     False),  # outside the schema
    ("required", "<|channel|>final<|message|>No call.<|return|>", False),
    ("auto", "<|channel|>final <|constrain|>json<|message|>{}<|return|>", True),
    ("auto", "<|channel|>final<|message|>Done<|call|>", False),  # an answer ends in <|return|>
    ({"type": "function", "function": {"name": "get_time"}},
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>', False),
    (JSON_FORMAT, '<|channel|>analysis<|message|>{no<|end|><|start|>assistant<|channel|>final <|constrain|>json'
                  '<|message|>{"ok": "yes"}<|return|>', True),
    (JSON_FORMAT, '<|channel|>final<|message|>{"ok": "maybe"}<|return|>', False),
    (JSON_FORMAT, "<|channel|>analysis<|message|>Hm<|end|><|return|>", False),  # no answer yet: no stop
])
def test_harmony_grammars_take_the_forms_gpt_oss_writes(config, grammar, output, accepted):
    """The tool grammar and a response_format's, compiled as the engine compiles them (a vocabulary that
    spells harmony's markers), fed harmony outputs token by token (the markers as their control tokens)."""
    from graphserve.engine.request import SamplingParams
    from graphserve.engine.structured.grammar import GrammarCompiler
    from graphserve.engine.tokenizer import Tokenizer
    from graphserve.server.protocol import ChatCompletionRequest
    from graphserve.server.reasoning import ReasoningConfig
    from graphserve.server.structured_request import grammar_from_request
    from graphserve.server.tools import HARMONY, tool_grammar

    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": WEATHER}}]
    if grammar == JSON_FORMAT:
        body = ChatCompletionRequest.model_validate({"messages": HI, "response_format": {
            "type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}})
        spec = ReasoningConfig("gpt-oss").adjust(SamplingParams(grammar=grammar_from_request(body))).grammar
    else:
        body = ChatCompletionRequest.model_validate({"messages": HI, "tools": tools, "tool_choice": grammar})
        spec = tool_grammar(HARMONY, body)
    tokenizer = Tokenizer(config.model)
    stops = [tokenizer.special_tokens["<|return|>"], tokenizer.special_tokens["<|call|>"]]
    compiler = GrammarCompiler(config.model, tokenizer.vocab_size, stops)
    matcher = compiler.matcher(compiler.compile(spec))
    ids = tokenizer.encode(output, add_special_tokens=False)
    assert all(matcher.accept_token(token) for token in ids) == accepted
    assert matcher.is_terminated() == accepted
    compiler.close()


def test_warm_up_reads_the_harmony_view_of_the_vocabulary_too(config):
    """A model whose special tokens hold harmony's markers needs two views of its vocabulary (harmony
    grammars spell the markers, the others forbid them): warm-up builds both, as a server's does."""
    import time

    from graphserve.engine.structured.grammar import GrammarCompiler
    from graphserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(config.model)
    compiler = GrammarCompiler(config.model, tokenizer.vocab_size, [tokenizer.special_tokens["<|return|>"]])
    assert not compiler.vocabulary_loaded
    compiler.warm()
    deadline = time.monotonic() + 30
    while not compiler.vocabulary_loaded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert compiler.vocabulary_loaded
    compiler.close()
