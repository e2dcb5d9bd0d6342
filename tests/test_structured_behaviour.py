"""Constrained output as a client sees it, over HTTP with the official openai client: the
documented bounds of a spec (64 KiB, 1,024 choices) at their edges, what a JSON schema allows
(only its properties, compactly written, strings a strict JSON parser reads) even where the
model is pushed hard the other way with logit_bias, every way of asking for a constraint, and
the 400s naming the field for the malformed ones."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve import AsyncEngine, EngineConfig
from graphserve.engine.tokenizer import Tokenizer
from graphserve.server.app import create_app
from live_server import BackgroundServer
from tiny_models import _bytes_to_unicode, make_tiny_model

PROMPT = "Describe a person as JSON:"
SPEC_LIMIT = 64 * 1024  # README: "one over 64 KiB ... is a 400 naming the field"
CHOICE_LIMIT = 1024


@pytest.fixture(scope="module")
def engine() -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=None, device="cpu", max_num_seqs=8, decode_chunk=4, max_model_len=512,
                                   kv_cache_bytes=32 * 1024**2))


@pytest.fixture(scope="module")
def server(engine: AsyncEngine) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(engine)) as background:
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def tokenizer(engine: AsyncEngine, server) -> Tokenizer:  # the model is prepared once the server is up
    return Tokenizer(engine.model_path)


def complete(oai, model, extra: dict, **kw) -> openai.types.Completion:
    kw = {"max_tokens": 40, "temperature": 0, **kw}
    return oai.completions.create(model=model, prompt=kw.pop("prompt", PROMPT), extra_body=extra, **kw)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=120,
                      json={"prompt": "hi", "max_tokens": 4, **body})


def assert_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def padded_schema(length: int) -> dict:
    """A JSON schema whose text (as the server writes it) is exactly `length` characters."""
    schema = {"type": "string", "maxLength": 2, "description": ""}
    schema["description"] = "x" * (length - len(json.dumps(schema)))
    assert len(json.dumps(schema)) == length
    return schema


def test_a_spec_of_64_kib_is_served_and_one_character_more_is_a_400(server, oai, model):
    out = complete(oai, model, {"guided_json": padded_schema(SPEC_LIMIT)}, max_tokens=8)
    assert isinstance(json.loads(out.choices[0].text), str) and out.choices[0].finish_reason == "stop"
    assert_400(post(server, {"guided_json": padded_schema(SPEC_LIMIT + 1)}), "guided_json")


def test_1024_choices_are_served_and_1025_are_a_400(server, oai, model):
    choices = [f"option {i}" for i in range(CHOICE_LIMIT)]
    # room for the longest choice spelled a byte a token, and the end: the grammar then ends every
    # output, whichever spelling and choice the model's greedy pick (which differs by CPU) takes
    longest = max(len(c.encode()) for c in choices)
    out = complete(oai, model, {"guided_choice": choices}, max_tokens=longest + 1)
    assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop"
    assert_400(post(server, {"guided_choice": [*choices, "one more"]}), "guided_choice")


# ---- what a vocabulary can spell: surrogates ------------------------------------------------------
# A byte-level vocabulary may hold tokens whose bytes spell U+D800-DFFF (ED A0-BF xx), which no valid
# UTF-8 holds: the client would get U+FFFD for them. A tiny model whose vocabulary has such tokens
# (its byte tokens, ids 3..258, plus these), pushed towards them as hard as logit_bias allows.

SURROGATE_TOKENS = {259: b"\xed\xa0\x80",  # U+D800
                    260: b"\xed\xbf\xbf",  # U+DFFF
                    261: "\ud55c".encode() + b"\xed\xa0\x80"}  # a Hangul syllable (ED 95 9C), then U+D800
BESIDE_SURROGATES = {262: "\ud7ff".encode(), 263: "\ue000".encode()}  # ED 9F BF and EE 80 80: valid
ANY_TEXT = r"[^a]{1,4}"


@pytest.fixture(scope="module")
def surrogate_llm(tmp_path_factory):
    from graphserve import LLM

    path = make_tiny_model(tmp_path_factory.mktemp("surrogates") / "llama", "llama")
    spell = _bytes_to_unicode()
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    for token_id, data in {**SURROGATE_TOKENS, **BESIDE_SURROGATES}.items():
        tokenizer["model"]["vocab"]["".join(spell[b] for b in data)] = token_id
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    llm = LLM(str(path), device="cpu", num_kv_blocks=32, max_model_len=128)
    llm.byte_token = {b: tokenizer["model"]["vocab"][spell[b]] for b in range(256)}
    return llm


def constrained(llm, bias: dict[int, float], pattern: str = ANY_TEXT, max_tokens: int = 6):
    from graphserve import SamplingParams
    from graphserve.engine.structured.grammar import GrammarSpec

    return llm.generate([[5, 6, 7]], SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=bias,
                                                    grammar=GrammarSpec("regex", pattern)))[0]


def test_a_token_spelling_a_surrogate_is_never_output(surrogate_llm):
    out = constrained(surrogate_llm, {token_id: 100 for token_id in SURROGATE_TOKENS})
    assert not set(out.token_ids) & set(SURROGATE_TOKENS), out.token_ids
    assert "\ufffd" not in out.text and re.fullmatch(r"[^a]{1,4}", out.text.removesuffix("</s>")), ascii(out.text)


def test_the_characters_beside_the_surrogates_are_output(surrogate_llm):
    for token_id, data in BESIDE_SURROGATES.items():
        out = constrained(surrogate_llm, {token_id: 100})
        assert out.token_ids[:4] == [token_id] * 4 and out.text.startswith(data.decode() * 4), ascii(out.text)


def test_a_lead_byte_is_never_followed_by_a_surrogates_second_byte(surrogate_llm):
    """Byte by byte: ED, then A0-BF would spell a surrogate; ED 80-9F is Hangul and other valid text."""
    ed, a0, bf = (surrogate_llm.byte_token[b] for b in (0xED, 0xA0, 0xBF))
    out = constrained(surrogate_llm, {ed: 100, a0: 90, bf: 90}, max_tokens=6)  # two characters
    assert out.token_ids[0] == ed and "\ufffd" not in out.text, (out.token_ids, ascii(out.text))
    assert not {a0, bf} & {out.token_ids[i + 1] for i, t in enumerate(out.token_ids[:-1]) if t == ed}
    nine_f = surrogate_llm.byte_token[0x9F]
    out = constrained(surrogate_llm, {ed: 100, nine_f: 90}, max_tokens=3)
    assert out.token_ids[:2] == [ed, nine_f] and "\ud7c0" <= out.text[0] <= "\ud7ff", (out.token_ids, ascii(out.text))


# ---- the graph decoder's mask feed -----------------------------------------------------------------


def test_one_step_rounds_of_the_graph_decoder_keep_every_grammar_token(caplog):
    """`--decode-chunk 1` with the graph decoder (its path on CPU: eager replays of the static buffers):
    each round of constrained rows continues from the one before, whose single token the matchers
    must take first. No round fails (a failed round is logged and its requests retried one by one,
    off the launched-ahead path), and the outputs equal the plain path's, token for token, and parse."""
    import logging

    from graphserve import LLM, SamplingParams
    from graphserve.engine.runner.cuda_graphs import GraphDecoder
    from graphserve.engine.structured.grammar import GrammarSpec

    llm = LLM(device="cpu", max_model_len=256, num_kv_blocks=64, decode_chunk=1)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    prompts = [PROMPT, PROMPT, "Name a number:"]
    params = [SamplingParams(max_tokens=30, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(schema))),
              SamplingParams(max_tokens=30, temperature=0.8, seed=5, grammar=GrammarSpec("json_object")),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    plain = llm.generate(prompts, params)
    core = llm.engine.core
    core.worker.graphs = GraphDecoder(core.worker.runner, max_batch=4, max_steps=1,
                               table_width=-(-core.max_model_len // core.config.block_size), use_cuda_graphs=False)
    core.worker.graphs.capture(progress=False)
    try:
        with caplog.at_level(logging.WARNING, logger="graphserve"):
            outs = llm.generate(prompts, params)
    finally:
        core.worker.graphs = None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text[-2000:]
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in plain]
    assert set(json.loads(outs[0].text)) == {"name", "age"} and outs[0].finish_reason == "stop", outs[0].text


# ---- what a JSON schema allows --------------------------------------------------------------------

JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def bias_towards(tokenizer: Tokenizer, texts: list[str], value: float = 30) -> dict[str, float]:
    return {str(tokenizer.encode(text)[0]): value for text in texts}


def test_a_json_schema_allows_only_its_properties_compactly_written_even_when_pushed(oai, model, tokenizer):
    """xgrammar's strict mode (no property the schema does not name, additionalProperties unset) and
    no free whitespace between tokens, whatever logit_bias pushes towards: commas, spaces, newlines."""
    schema = {"type": "object", "properties": {"age": {"type": "integer"}, "city": {"type": "string", "maxLength": 8}},
              "required": ["age"]}
    bias = bias_towards(tokenizer, [",", " ", "\n", "\t", "  "])
    for extra in ({"guided_json": schema},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}):
        choice = complete(oai, model, extra, max_tokens=40, logit_bias=bias).choices[0]
        value = json.loads(choice.text)
        assert set(value) <= {"age", "city"} and "age" in value, choice.text
        skeleton = JSON_STRING.sub('""', choice.text)  # what is outside the strings
        assert skeleton == skeleton.strip() and not re.search(r"\s\s|[\n\r\t]|\s[,:}\]]", skeleton), choice.text


def test_json_strings_hold_no_raw_control_characters_even_when_pushed(oai, model, tokenizer):
    """A strict JSON parser (json.loads) refuses a raw control character inside a string: none is
    ever output, in a length-bounded string too (xgrammar's own class for those lets them through)."""
    schema = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 6}},
              "required": ["note"], "additionalProperties": False}
    bias = bias_towards(tokenizer, ["\t", "\x05", "\x01", "\x1f"], 40)
    choice = complete(oai, model, {"guided_json": schema}, max_tokens=40, logit_bias=bias).choices[0]
    assert choice.finish_reason == "stop", choice.text
    value = json.loads(choice.text)  # strict: raises on a raw control character
    assert len(value["note"]) <= 6, choice.text


def test_json_mode_allows_any_keys(oai, model, tokenizer):
    """response_format json_object: any object, not only {} (no properties are named, none are refused)."""
    bias = bias_towards(tokenizer, ['"'], 20)
    for extra in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        choice = complete(oai, model, extra, max_tokens=12, logit_bias=bias).choices[0]
        assert choice.text.startswith('{"'), choice.text


# ---- compilation under tensor parallelism --------------------------------------------------------


def _slow_grammar_rank(rank: int, size: int, init_method: str, model: str):
    import threading
    import time

    import torch

    from graphserve import LLM, SamplingParams
    from graphserve.engine.structured.grammar import GrammarSpec

    torch.set_num_threads(1)
    llm = LLM(model, device="cpu", num_kv_blocks=32, max_model_len=128, tensor_parallel_size=size, tp_rank=rank,
              tp_init_method=init_method, grammar_compile_timeout=1.0)
    compiler = llm.engine.core.structured.compiler
    real, released = compiler.compile, threading.Event()

    def slow_compile(spec):
        released.wait(60)
        return real(spec)

    compiler.compile = slow_compile
    start = time.monotonic()
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0,
                                                       grammar=GrammarSpec("regex", "[a-z]{1,3}")))[0]
    finally:
        released.set()
    return out.finish_reason, out.error, time.monotonic() - start


def test_a_grammar_compiling_past_its_timeout_fails_on_time_under_tensor_parallelism(surrogate_llm):
    """Every rank must admit the same requests, so the engine waits for the grammars compiling, but
    only until their deadline: then the request ends with its error, as with one rank. (Two ranks of
    the tiny model above, each slowing its own core's compilation past the timeout.)"""
    from graphserve.engine.distributed import run_on_ranks

    results = run_on_ranks(_slow_grammar_rank, 2, (str(surrogate_llm.engine.model_path),), timeout=120)
    for finish_reason, error, took in results:
        assert finish_reason == "error" and "longer than 1s to compile" in error, (finish_reason, error)
        assert took < 15, took


# ---- the request's fields -----------------------------------------------------------------------


def test_a_schema_may_be_given_as_json_text(oai, model):
    """vLLM's guided_json and structured_outputs.json take the schema as an object or as its JSON text."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for extra in ({"guided_json": json.dumps(schema)}, {"structured_outputs": {"json": json.dumps(schema)}}):
        choice = complete(oai, model, extra, max_tokens=12).choices[0]
        assert set(json.loads(choice.text)) == {"ok"} and choice.finish_reason == "stop", (extra, choice.text)


def test_response_format_text_is_free_text(oai, model):
    free = complete(oai, model, {}, max_tokens=12, prompt="Once upon a time")
    text = complete(oai, model, {"response_format": {"type": "text"}}, max_tokens=12, prompt="Once upon a time")
    assert text.choices[0].text == free.choices[0].text and text.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"structured_outputs": {"json": "17"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"guided_choice": ["yes", ""]}, "guided_choice"),
], ids=["schema-text-not-json", "schema-text-a-list", "schema-text-a-number", "no-constraint", "json-object-false", "empty-choice"])
def test_malformed_constraints_are_400s_naming_the_field(server, body, param):
    assert_400(post(server, body), param)


def test_grammars_keep_compiling_once_the_cache_is_full(oai, model, monkeypatch):
    """Compiled grammars are kept up to a size (512 MiB; here a few bytes, so that every new one
    drops the least recently used): each request is still served, and one seen before compiles again."""
    from graphserve.engine.structured import grammar

    monkeypatch.setattr(grammar, "GRAMMAR_CACHE_BYTES", 1)
    patterns = [r"[0-9]{3}", r"[a-c]{2}x", r"z[0-9]{2}", r"[0-9]{3}"]
    for pattern in patterns:
        choice = complete(oai, model, {"guided_regex": pattern}, max_tokens=8).choices[0]
        assert re.fullmatch(pattern, choice.text) and choice.finish_reason == "stop", (pattern, choice.text)


def test_a_grammar_seen_before_is_not_compiled_again(oai, model, monkeypatch):
    """Compiling a grammar can take seconds: while the cache has room, a request repeating an earlier
    request's constraint is served without compiling it again."""
    import xgrammar as xgr

    compiled = []
    real = xgr.GrammarCompiler.compile_grammar

    def counting(self, grammar, *args, **kwargs):
        compiled.append(grammar)
        return real(self, grammar, *args, **kwargs)

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_grammar", counting)
    patterns = [r"q[0-9]{2}", r"[d-f]{2}q", r"w[a-c]w"]  # no other test here uses these
    for repeat in range(2):
        for pattern in patterns:
            choice = complete(oai, model, {"guided_regex": pattern}, max_tokens=8).choices[0]
            assert re.fullmatch(pattern, choice.text) and choice.finish_reason == "stop", (pattern, choice.text)
        if repeat == 0:
            first_pass = len(compiled)
            assert first_pass >= len(patterns), compiled
    assert len(compiled) == first_pass, compiled[first_pass:]


def test_a_choice_is_written_exactly_control_characters_and_all(oai, model):
    """A choice reaches the client as given: newlines, a tab, a carriage return, another control
    character, characters past ASCII."""
    for text in ("one\ntwo", "tab\there", "a\r\nb", "bell\x07", "\u00e9\u2028z"):
        choice = complete(oai, model, {"guided_choice": [text]}, max_tokens=12).choices[0]
        assert choice.text == text and choice.finish_reason == "stop", (text, choice.text)

def test_the_python_api_refuses_an_empty_choice(surrogate_llm):
    """An empty string would let the output be empty: LLM.generate refuses it, naming the field,
    as the HTTP server refuses guided_choice [""]."""
    from graphserve import SamplingParams
    from graphserve.engine.errors import InvalidRequestError
    from graphserve.engine.structured.grammar import GrammarSpec

    for choices in (["yes", ""], [""]):
        with pytest.raises(InvalidRequestError, match="non-empty strings") as info:
            surrogate_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, grammar=GrammarSpec(
                "choice", json.dumps(choices), param="guided_choice")))
        assert info.value.param == "guided_choice"
