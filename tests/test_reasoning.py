"""Reasoning parsers (server/reasoning.py, `--reasoning-parser`) through the official `openai`
client: a tiny model whose greedy output is known (tests/tiny_models.make_thinking_model: a
bigram table over a byte tokenizer with <think>/</think> as tokens) thinks, then answers;
`reasoning_content` holds exactly the thinking, `content` exactly the answer, streamed and
not, and the concatenated stream equals the whole message; chat_template_kwargs reach the
template; usage counts the reasoning tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve import AsyncEngine, EngineConfig
from graphserve.server.app import create_app
from graphserve.server.reasoning import ReasoningSplitter, parser_name
from graphserve.server.settings import SettingsError, merge_settings
from live_server import BackgroundServer
from tiny_models import make_thinking_model

HI = [{"role": "user", "content": "Hi"}]
ANSWER = "\n\nThe answer is 42"


def _server(tmp_path_factory, parser: str) -> Iterator[BackgroundServer]:
    path = make_thinking_model(tmp_path_factory.mktemp(parser) / "m", parser)
    config = EngineConfig(model=str(path), device="cpu", max_num_seqs=4, decode_chunk=2, max_model_len=256,
                          kv_cache_bytes=8 * 1024**2, warm_up=False)
    with BackgroundServer(create_app(AsyncEngine(config), reasoning_parser=parser)) as background:
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Iterator[openai.OpenAI]:
    for server in _server(tmp_path_factory, "qwen3"):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Iterator[openai.OpenAI]:
    for server in _server(tmp_path_factory, "deepseek-r1"):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def chat(client, stream: bool, **kw):
    """(reasoning, content, finish_reason, usage) of one choice, whole or reassembled from the stream."""
    kw = dict(model=client.models.list().data[0].id, messages=HI, temperature=0, **{"max_tokens": 32, **kw})
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert m.model_extra.get("reasoning") == m.model_extra.get("reasoning_content")
        return m.model_extra.get("reasoning_content"), m.content, r.choices[0].finish_reason, r.usage
    reasoning, content, finish, usage, order = None, None, None, None, []
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
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
    assert order == sorted(order, reverse=True)  # all thinking deltas before any answer delta
    return reasoning, content, finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_qwen3_thinking_then_answer(qwen3, stream):
    reasoning, content, finish, usage = chat(qwen3, stream)
    assert (reasoning, content, finish) == ("\nLet me think", ANSWER, "stop")
    # "\n", "Let", " me", " think": the tags are not counted
    assert usage.completion_tokens_details.reasoning_tokens == 4
    assert usage.completion_tokens == 12  # <think> \n Let me think </think> \n\n The answer is 42, and the EOS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_qwen3_enable_thinking_false_is_all_answer(qwen3, stream):
    """chat_template_kwargs reach the template: it closes an empty thinking in the prompt, and the
    output without tags is all content."""
    reasoning, content, finish, usage = chat(qwen3, stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (reasoning, content, finish) == (None, "The answer is 42", "stop")
    assert usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_deepseek_r1_output_starts_inside_the_thinking(deepseek, stream):
    reasoning, content, finish, usage = chat(deepseek, stream)
    assert (reasoning, content, finish) == ("Let me think", ANSWER, "stop")
    assert usage.completion_tokens_details.reasoning_tokens == 3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("parser", ["qwen3", "deepseek"])
def test_thinking_never_closed_is_all_reasoning(qwen3, deepseek, parser, stream):
    """Cut by max_tokens inside the thinking: all of it is reasoning, no content (as vLLM)."""
    client = qwen3 if parser == "qwen3" else deepseek
    reasoning, content, finish, _ = chat(client, stream, max_tokens=3)
    expected = "\nLet" if parser == "qwen3" else "Let me think"
    assert (reasoning, content, finish) == (expected, None, "length")


def test_template_kwargs_cannot_replace_the_messages_and_are_bounded(qwen3):
    model = qwen3.models.list().data[0].id
    r = qwen3.chat.completions.create(model=model, messages=HI, max_tokens=32, temperature=0,
                                      extra_body={"chat_template_kwargs": {"messages": [], "enable_thinking": False}})
    assert r.choices[0].message.content == "The answer is 42"
    with pytest.raises(openai.BadRequestError) as err:
        qwen3.chat.completions.create(model=model, messages=HI, max_tokens=4, extra_body={
            "chat_template_kwargs": {f"k{i}": i for i in range(65)}})
    assert err.value.body["param"].startswith("chat_template_kwargs")


# ---- the splitter alone --------------------------------------------------------------------------


@pytest.mark.parametrize("parser, starts_inside, text, expected", [
    ("qwen3", False, "<think>\nhmm</think>\n\nanswer", ("\nhmm", "\n\nanswer")),
    ("qwen3", False, "  <think>a</think>", ("a", None)),
    ("qwen3", False, "no tags at all", (None, "no tags at all")),
    ("qwen3", False, "<thin", (None, "<thin")),
    ("qwen3", False, "<think>never closed </thi", ("never closed </thi", None)),
    ("qwen3", True, "inside</think>out", ("inside", "out")),
    ("deepseek-r1", False, "inside</think>out", ("inside", "out")),
    ("deepseek-r1", False, "<think>inside</think>out", ("inside", "out")),
    ("deepseek-r1", False, "never closed", ("never closed", None)),
    ("deepseek-r1", False, "</think>", ("", None)),
])
def test_splitter_fed_piecewise_equals_whole(parser, starts_inside, text, expected):
    for size in (len(text) or 1, 1, 2, 3, 5):
        s = ReasoningSplitter(parser, starts_inside)
        streamed = ["", ""]
        for i in range(0, len(text), size):
            r, c = s.feed(text[i:i + size])
            streamed[0] += r
            streamed[1] += c
        r, c = s.finish()
        streamed[0] += r
        streamed[1] += c
        assert s.message_fields() == expected
        assert tuple(streamed) == (expected[0] or "", expected[1] or "")


def test_unknown_parser_names_the_choices():
    assert parser_name("deepseek_r1") == "deepseek-r1"
    assert (parser_name(None), parser_name("none"), parser_name("openai_gptoss")) == ("auto", "none", "gpt-oss")
    with pytest.raises(ValueError, match="qwen3, deepseek-r1, gpt-oss, auto, none"):
        parser_name("granite")
    with pytest.raises(SettingsError, match="qwen3, deepseek-r1, gpt-oss, auto, none"):
        merge_settings({}, {"reasoning_parser": "nope"})


YES_NO = {"type": "object", "properties": {"ok": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["ok"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("parser", ["qwen3", "deepseek"])
def test_json_schema_starts_after_the_thinking(qwen3, deepseek, parser, stream):
    """The grammar leaves the thinking free (the model's own text, which the schema forbids) and
    constrains the answer after </think>: it parses and validates."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    client = qwen3 if parser == "qwen3" else deepseek
    fmt = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}
    reasoning, content, finish, _ = chat(client, stream, response_format=fmt, max_tokens=64)
    assert reasoning == ("\nLet me think" if parser == "qwen3" else "Let me think")
    assert finish == "stop", content
    jsonschema.validate(json.loads(content), YES_NO)
    # without thinking (enable_thinking=false) the schema applies from the output's start
    if parser == "qwen3":
        reasoning, content, _, _ = chat(client, stream, response_format=fmt, max_tokens=64,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert reasoning is None
        jsonschema.validate(json.loads(content), YES_NO)


# ---- gpt-oss: harmony's channels (server/harmony.py) ----------------------------------------------

CHAIN_OF = "<|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant<|channel|>final<|message|>{answer}<|return|>"


@pytest.mark.parametrize("output, expected", [
    (CHAIN_OF.format(thinking="Let me think", answer="The answer is 42"), ("Let me think", "The answer is 42")),
    # a preamble to the user (commentary, no recipient) is answer too
    ("<|channel|>analysis<|message|>Plan<|end|><|start|>assistant<|channel|>commentary<|message|>Checking. <|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done<|return|>", ("Plan", "Checking. Done")),
    # a harmony tool call (to=functions.NAME) is neither thinking nor answer
    ("<|channel|>analysis<|message|>Need the weather<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', ("Need the weather", None)),
    ("<|channel|>analysis<|message|>Cut in the thin", ("Cut in the thin", None)),  # max_tokens inside the thinking
    ("<|channel|>analysis<|message|>A<|end|><|start|>assistant<|chan", ("A", None)),  # cut inside a header
    # text outside any message's body (no header at all, or stray after one) is answer: never dropped
    ("<|channel|>final<|message|>An answer<|end|> and more<|return|>", (None, "An answer and more")),
    ("no harmony at all", (None, "no harmony at all")),
])
def test_gpt_oss_splits_harmony_as_the_engine_detokenizes_it(tmp_path, output, expected):
    """The output's token ids (harmony's markers one token each) detokenized as the engine streams them,
    a few ids at a time: with the special tokens kept (the parser's adjust() asks for it) the markers
    arrive as text, and whatever the chunking the thinking and the answer come out exact."""
    from graphserve.engine.detokenizer import IncrementalDetokenizer
    from graphserve.engine.request import SamplingParams
    from graphserve.engine.tokenizer import Tokenizer
    from graphserve.server.reasoning import reasoning_config
    from tiny_models import make_harmony_tokenizer

    tokenizer = Tokenizer(make_harmony_tokenizer(tmp_path / "harmony"))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    ids = tokenizer.encode(output, add_special_tokens=False)
    assert len(tokenizer.encode("<|channel|><|message|>", add_special_tokens=False)) == 2
    for size in (1, 2, 3, len(ids)):
        config = reasoning_config("gpt-oss", tokenizer, prompt)
        params = config.adjust(SamplingParams())
        assert params.skip_special_tokens is False
        detokenizer, splitter = IncrementalDetokenizer(tokenizer, params.skip_special_tokens), config.splitter(0)
        streamed = ["", ""]
        for i in range(0, len(ids), size):
            thinking, answer = splitter.feed(detokenizer.add(ids[i:i + size]))
            streamed = [streamed[0] + thinking, streamed[1] + answer]
        thinking, answer = splitter.finish()
        assert splitter.message_fields() == expected
        assert (streamed[0] + thinking, streamed[1] + answer) == (expected[0] or "", expected[1] or "")


def test_gpt_oss_grammars_start_at_the_final_channel_and_read_the_markers():
    """A response_format grammar applies to the final channel's message (reasoning "harmony"); a harmony
    tool grammar, which holds the thinking itself, is left as it is; both with the markers kept in the text."""
    from graphserve.engine.request import SamplingParams
    from graphserve.engine.structured.grammar import GrammarSpec
    from graphserve.server.reasoning import ReasoningConfig

    config = ReasoningConfig("gpt-oss")
    params = config.adjust(SamplingParams(grammar=GrammarSpec("json_object", param="response_format")))
    assert (params.grammar.reasoning, params.skip_special_tokens) == ("harmony", False)
    tools = GrammarSpec("structural_tag", "{}", param="tools", reasoning="harmony_messages")
    assert config.adjust(SamplingParams(grammar=tools)).grammar == tools


def test_the_parser_comes_from_the_chat_template_unless_named():
    from graphserve.server.reasoning import resolve_parser
    from tiny_models import HARMONY_TEMPLATE, THINK_TEMPLATES

    # DeepSeek-R1's first template: it strips the thinking from past answers; its model opens none
    r1 = "{% set content = message['content'].split('</think>')[-1] %}{{ '<\uff5cAssistant\uff5c>' }}"
    plain = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    # a template that opens <think> in its prompt gets qwen3, which starts inside it from the prompt
    for template, parser in [(HARMONY_TEMPLATE, "gpt-oss"), (THINK_TEMPLATES["qwen3"], "qwen3"),
                             (THINK_TEMPLATES["deepseek-r1"], "qwen3"), (r1, "deepseek-r1"), (plain, None),
                             (None, None)]:
        chosen, line = resolve_parser("auto", template)
        assert chosen == parser and line.startswith(f"reasoning parser: {parser or 'none'}")
        assert resolve_parser("none", template)[0] is None
        assert resolve_parser("deepseek-r1", template)[0] == "deepseek-r1"
