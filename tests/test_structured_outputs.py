"""Grammar-constrained decoding (engine/structured/grammar.py, matchers.py, server/structured_request.py): every
constrained output parses and validates, greedy and sampled; unconstrained requests beside
constrained ones keep their solo tokens; streamed equals not streamed; bad specs are 400s
naming the field; compilation is bounded and never holds up the engine; nothing leaks."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from pydantic import BaseModel

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a dev extra) validates the outputs")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve import LLM, AsyncEngine, EngineConfig, SamplingParams
from graphserve.engine.errors import InvalidRequestError
from graphserve.engine.structured.grammar import GrammarCompiler, GrammarSpec
from graphserve.kernels.bitmask import unpack_bitmask
from graphserve.server.app import create_app
from live_server import BackgroundServer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "enum": ["chess", "golf", "music"]}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON:"
FREE_PROMPTS = ["Once upon a time", "The capital of France is"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
EBNF = 'root ::= "(" digit+ ("+" digit+)* ")"\ndigit ::= [0-9]'


def spec(kind: str, value=None) -> GrammarSpec:
    return GrammarSpec(kind, value if isinstance(value, str) or value is None else json.dumps(value)) if value \
        else GrammarSpec(kind)


def check_output(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "grammar":
        assert re.fullmatch(r"\(\d+(\+\d+)*\)", text), text


SPECS = {"json_schema": spec("json_schema", PERSON), "json_object": spec("json_object"), "regex": spec("regex", REGEX),
         "choice": spec("choice", CHOICES), "grammar": spec("grammar", EBNF)}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=512, num_kv_blocks=128, decode_chunk=4)


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.grammar_requests == 0  # no matcher and no compilation left behind


# ---- the engine ----------------------------------------------------------------------------------


def test_unpacked_bitmask_is_xgrammars_mask():
    import xgrammar as xgr

    vocab = 1000
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), dtype=torch.int32)
    logits = torch.randn(3, vocab)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, backend="torch_native")
    got = logits.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def exact_llm() -> LLM:
    """The embedded model's dequantized float32 weights: greedy choices that do not hinge on the
    host's rounding of quantized activations (on one Xeon the Q4_1 path's greedy json_object output
    was an endless number, on another it closed)."""
    return LLM(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=128, decode_chunk=4)


@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_constrained_output_validates(exact_llm, kind):
    out = exact_llm.generate([PROMPT], SamplingParams(max_tokens=80, temperature=0, grammar=SPECS[kind]))[0]
    assert out.finish_reason == "stop", out.text  # the grammar ended it, not max_tokens
    check_output(kind, out.text)
    assert_idle(exact_llm)


def test_sampled_n4_seeded_outputs_validate_and_repeat(llm):
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=s, grammar=SPECS["json_schema"]) for s in range(4)]
    first = llm.generate([PROMPT] * 4, params)
    for out in first:
        check_output("json_schema", out.text)
    assert len({o.text for o in first}) > 1  # different seeds, different (valid) samples
    again = llm.generate([PROMPT] * 4, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert_idle(llm)


def test_unconstrained_requests_beside_constrained_keep_their_tokens(llm):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)
    solo = [llm.generate([p], prm)[0].token_ids for p, prm in zip(FREE_PROMPTS, (free, seeded))]
    mixed = llm.generate([FREE_PROMPTS[0], PROMPT, FREE_PROMPTS[1], PROMPT],
                         [free, SamplingParams(max_tokens=80, temperature=0, grammar=SPECS["json_schema"]), seeded,
                          SamplingParams(max_tokens=20, temperature=0, grammar=SPECS["regex"])])
    assert [mixed[0].token_ids, mixed[2].token_ids] == solo
    check_output("json_schema", mixed[1].text)
    check_output("regex", mixed[3].text)
    assert_idle(llm)


def test_max_tokens_inside_the_grammar_ends_with_length(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, grammar=SPECS["json_schema"]))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert_idle(llm)


def test_min_tokens_yields_to_a_grammar_that_allows_only_its_end(llm):
    """min_tokens bans the end-of-sequence tokens; once the grammar allows nothing else, the
    grammar wins: the request ends with its complete output (found by the fuzz test: a 500)."""
    for temperature in (0, 1.0):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=20, min_tokens=15, temperature=temperature, seed=1,
                                                    grammar=SPECS["choice"]))[0]
        assert out.finish_reason == "stop" and out.text in CHOICES, (out.finish_reason, out.text)
    assert_idle(llm)


def test_bad_specs_are_rejected_before_they_run(llm):
    for bad, param in ((GrammarSpec("json_schema", '{"type": "frog"}'), "response_format"),
                       (GrammarSpec("regex", "a(b", param="guided_regex"), "guided_regex"),
                       (GrammarSpec("grammar", "root ::= undefined_rule"), "response_format"),
                       (GrammarSpec("xml", "<a/>"), "response_format"),
                       (GrammarSpec("regex", "a" * 70_000), "response_format")):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate([PROMPT], SamplingParams(max_tokens=4, grammar=bad))
        assert info.value.param == param
    assert_idle(llm)


def test_a_slow_compilation_does_not_hold_up_other_requests(llm, monkeypatch):
    """The core compiles in a worker thread; meanwhile it keeps decoding the others."""
    real = GrammarCompiler.compile
    released = threading.Event()

    def slow_compile(self, spec):
        released.wait(30)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", slow_compile)
    core = llm.engine.core
    monkeypatch.setattr(core.structured.compiler, "timeout_s", 300.0)
    slow = core.add_request("slow", llm.engine.inputs.check(PROMPT, SamplingParams(max_tokens=8))[0],
                            SamplingParams(max_tokens=40, temperature=0, grammar=spec("regex", r"[a-z]{1,9}")))
    free = core.add_request("free", llm.engine.inputs.check(FREE_PROMPTS[0], SamplingParams())[0],
                            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    while not free.is_finished:  # the free request runs to its end while the grammar still compiles
        core.step()
        assert not slow.is_finished
    assert slow.num_output_tokens == 0 and core.structured.compiling
    released.set()
    deadline = time.monotonic() + 60
    while not slow.is_finished and time.monotonic() < deadline:
        core.step()
    assert re.fullmatch(r"[a-z]{1,9}", llm.tokenizer.decode(slow.output_token_ids))
    assert_idle(llm)


def test_constrained_rows_keep_k_step_rounds_with_the_tokens_of_one_step_rounds(llm):
    """A grammar needs the host between two tokens, but constrained rows still run K-step
    rounds (their masks are fed between the steps): the tokens, greedy and seeded-sampled,
    are those of one-step rounds, in about a K-th of the rounds."""
    one_step = LLM(device="cpu", max_model_len=512, num_kv_blocks=128, decode_chunk=1)
    params = [SamplingParams(max_tokens=60, temperature=0, grammar=SPECS["json_schema"]),
              SamplingParams(max_tokens=60, temperature=1.0, seed=11, grammar=SPECS["json_object"]),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    prompts = [PROMPT, PROMPT, FREE_PROMPTS[1]]
    before = llm.engine.stats().decode_rounds
    outs = llm.generate(prompts, params)
    rounds = llm.engine.stats().decode_rounds - before
    want = one_step.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    check_output("json_schema", outs[0].text)
    longest = max(len(o.token_ids) for o in outs)
    assert rounds <= -(-longest // 4) + 2, (rounds, longest)  # K = 4, not one round per token
    assert_idle(llm)


def test_a_failed_round_rolls_the_matchers_back(llm):
    """Tokens a matcher took inside a round that then failed are rolled back, so the retry
    (or the next round) starts from the matcher state the host's tokens say."""
    from graphserve.engine.request import Sequence

    structured = llm.engine.core.structured
    compiled = structured.compiler.compile(SPECS["regex"])
    import xgrammar as xgr

    seq = Sequence("rollback-test", [1, 2], SamplingParams(max_tokens=8, grammar=SPECS["regex"]), seed=0)
    structured.matchers[seq.request_id] = xgr.GrammarMatcher(compiled)
    try:
        digits = [llm.tokenizer.encode(d)[0] for d in "123"]
        masks = torch.empty(1, structured.words, dtype=torch.int32)
        for token in digits:
            structured.advance([seq], [0], [token], masks)
        assert masks[0].ne(-1).any()  # after three digits only "-" may follow
        structured.forget_taken()
        assert [structured.accept(seq.request_id, t) for t in digits] == [(True, False)] * 3
        structured.advance([seq], [0], [digits[0]], masks)  # a fourth digit: outside the grammar
        assert structured.accept(seq.request_id, digits[0]) == (False, False)
    finally:
        structured.release(seq.request_id)


def test_graph_decoder_feeds_masks_into_rounds_launched_ahead(llm):
    """The graph decoder's path (static buffers; eager on CPU): grammar rows' masks are fed
    by the mask feed's worker thread while the round runs, and rounds with grammar rows are
    launched ahead of the one in flight. Every token equals the plain eager path's (which
    computes each mask between the steps itself), greedy and seeded-sampled, constrained and free."""
    from graphserve.engine.runner.cuda_graphs import GraphDecoder

    core = llm.engine.core
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [PROMPT, FREE_PROMPTS[0], PROMPT, "Name a number:"]
    params = [SamplingParams(max_tokens=80, temperature=0, grammar=SPECS["json_schema"]), free,
              SamplingParams(max_tokens=80, temperature=0.8, seed=3, grammar=SPECS["json_schema"]),
              SamplingParams(max_tokens=30, temperature=0, grammar=SPECS["choice"])]
    eager = llm.generate(prompts, params)
    core.worker.graphs = GraphDecoder(core.worker.runner, max_batch=4, max_steps=core.config.decode_chunk,
                               table_width=-(-core.max_model_len // core.config.block_size), use_cuda_graphs=False)
    core.worker.graphs.capture(progress=False)
    try:
        ahead_before = core.stats().decode_rounds_ahead
        outs = llm.generate(prompts, params)
        assert core.stats().decode_rounds_ahead > ahead_before
    finally:
        core.worker.graphs = None
    check_output("json_schema", outs[0].text)
    check_output("json_schema", outs[2].text)
    check_output("choice", outs[3].text)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert_idle(llm)


# text a constraint spells out is the text it accepts, whatever its characters: below U+0100 before a hex
# digit (xgrammar prints "î7" as \xee7 and reads that back as U+0EE7), past the BMP (JSON escapes write
# surrogate pairs), control characters, quotes and backslashes
LITERALS = ["\u00ee7", "caf\u00e9 2b", "\U0001f600 ok", "\U000efe8c", "tab\there", "\x05a", 'say "hi" \\ 0',
            "\u4e2d1"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_choice_is_output_exactly_as_written(llm, temperature):
    for literal in LITERALS:
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=3,
                                grammar=spec("choice", [literal]))
        out = llm.generate([PROMPT], params)[0]
        assert (out.text, out.finish_reason) == (literal, "stop"), ascii(literal)
    assert_idle(llm)


def test_a_schema_enum_is_output_exactly_as_written(llm):
    """A schema with a length-bounded string (its grammar is rewritten as text: json_strings_without_controls)."""
    schema = {"type": "object", "properties": {"tag": {"enum": LITERALS}, "note": {"type": "string", "maxLength": 4}},
              "required": ["tag", "note"], "additionalProperties": False}
    for seed in range(4):
        params = SamplingParams(max_tokens=48, temperature=1.0, seed=seed, grammar=spec("json_schema", schema))
        out = llm.generate([PROMPT], params)[0]
        assert out.finish_reason == "stop", ascii(out.text)
        assert json.loads(out.text)["tag"] in LITERALS, ascii(out.text)
    assert_idle(llm)


# ---- the HTTP server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=None, device="cpu", max_num_seqs=16, decode_chunk=4, max_model_len=512,
                                   kv_cache_bytes=64 * 1024**2))


@pytest.fixture(scope="module")
def server(engine: AsyncEngine) -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(engine)) as background:
        background.wait_ready()
        yield background


class Person(BaseModel):
    name: str
    age: int


def test_parse_with_a_pydantic_model(oai, model):
    completion = oai.chat.completions.parse(model=model, messages=[{"role": "user", "content": PROMPT}],
                                            response_format=Person, max_tokens=80, temperature=0)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"


def test_chat_response_format_streamed_equals_not_streamed(oai, model):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model=model, messages=[{"role": "user", "content": PROMPT}], response_format=response_format,
              max_tokens=80, temperature=0)
    text = oai.chat.completions.create(**kw).choices[0].message.content
    check_output("json_schema", text)
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == text


def test_completions_extensions_and_n_sampled(oai, model):
    for extra, kind in (({"structured_outputs": {"regex": REGEX}}, "regex"),
                        ({"structured_outputs": {"choice": CHOICES}}, "choice"),
                        ({"structured_outputs": {"grammar": EBNF}}, "grammar"),
                        ({"guided_json": PERSON}, "json_schema"),
                        ({"guided_choice": CHOICES}, "choice")):
        out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=80, temperature=0, extra_body=extra)
        check_output(kind, out.choices[0].text)
    sampled = oai.completions.create(model=model, prompt=PROMPT, max_tokens=96, temperature=1.0, n=4, seed=7,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"schema": PERSON}}})
    for choice in sampled.choices:
        check_output("json_schema", choice.text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frog"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= nothing_here"}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "guided_json"),
    ({"structured_outputs": {"regex": "a" * 70_000}}, "structured_outputs"),
], ids=["bad-schema", "no-schema", "unknown-type", "bad-regex", "two-kinds", "bad-ebnf", "two-fields", "bad-ref",
        "too-large"])
def test_bad_constraints_are_400s_naming_the_field(server, model, body, param):
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.url + path, json={"model": model, "max_tokens": 4, **base, **body}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_a_choice_with_an_unpaired_surrogate_is_refused(server, model, llm):
    """No UTF-8 spells a lone surrogate (JSON can write one: \\ud800), so no token could output it: over
    HTTP the body's JSON is refused; through the Python API, the choice."""
    body = '{"model": "%s", "prompt": "hi", "max_tokens": 4, "guided_choice": ["ok", "a\\ud800"]}' % model
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    with pytest.raises(InvalidRequestError, match="unpaired surrogate"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, grammar=spec("choice", ["ok", "a\ud800"])))
    assert_idle(llm)


def test_a_choice_the_vocabulary_cannot_write_is_a_400_not_a_500(oai, model, llm):
    """The embedded model's byte-level vocabulary has no token for the byte F1, the lead byte of
    U+40000-7FFFF: a choice holding such a character reaches a point where no token may follow."""
    from graphserve.engine.tokenizer import Tokenizer

    unwritable = "x\U00040000"
    tokenizer = Tokenizer(llm.engine.model_path)
    assert tokenizer.decode(tokenizer.encode(unwritable)) != unwritable
    with pytest.raises(openai.BadRequestError, match="vocabulary cannot write"):
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, extra_body={"guided_choice": [unwritable]})
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, grammar=spec("choice", [unwritable])))[0]
    assert (out.text, out.finish_reason) == ("x", "error") and "vocabulary cannot write" in out.error
    assert_idle(llm)


def test_a_grammar_that_compiles_too_long_is_a_400(server, engine, model, monkeypatch):
    real = GrammarCompiler.compile

    def slow_compile(self, spec):
        time.sleep(1.0)
        return real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", slow_compile)
    monkeypatch.setattr(engine.grammars, "timeout_s", 0.2)
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": "hi", "max_tokens": 4, "guided_regex": "[a-z]{1,77}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    assert "compile" in r.json()["error"]["message"]


def test_nothing_leaks_after_all_requests(server):
    client = httpx.Client(base_url=server.url)
    deadline = time.monotonic() + 30
    while True:
        text = client.get("/metrics").text
        values = {name: float(re.search(rf"^graphserve_{name} (\S+)$", text, re.M).group(1))
                  for name in ("grammar_requests", "kv_blocks_free", "kv_blocks_total", "num_requests_running")}
        if (values["grammar_requests"] == 0 and values["kv_blocks_free"] == values["kv_blocks_total"]
                and values["num_requests_running"] == 0):
            return
        assert time.monotonic() < deadline, values
        time.sleep(0.1)


def test_sampling_never_draws_a_masked_token():
    """Gumbel noise stays finite (a +inf once made a token win whatever its logit, mask or not)."""
    from graphserve.engine.sample.sampler import SamplingTensors, sample
    from graphserve.engine.sample.hash_random import hash_uniform

    vocab, rows = 49152, 256
    u = hash_uniform(torch.arange(rows), torch.arange(rows) * 7, vocab)
    assert 0 < u.min().item() and u.max().item() < 1
    bitmask = torch.zeros(rows, -(-vocab // 32), dtype=torch.int32)
    allowed = torch.randint(0, vocab, (rows,))
    bitmask[torch.arange(rows), allowed // 32] = (1 << (allowed % 32)).to(torch.int32)
    st = SamplingTensors(temperature=torch.ones(rows), top_k=torch.full((rows,), vocab), top_p=torch.ones(rows),
                         min_p=torch.zeros(rows), seeds=torch.arange(rows), output_pos=torch.zeros(rows, dtype=torch.long),
                         token_bitmask=bitmask)
    assert torch.equal(sample(torch.randn(rows, vocab), st).tokens, allowed)
