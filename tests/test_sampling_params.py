"""What users depend on in the sampling parameters, end to end: the offline `LLM` API and the real
server on loopback (the official `openai` client and httpx), both on a tiny random model.

- Seeds: every int64 is a valid seed (as OpenAI and vLLM accept), a seed reproduces its output, and
  choice i of a seeded request with n > 1 samples as a request with seed + i does, wrapping past
  2**63 - 1 to -2**63.
- Ranges: each parameter takes its whole documented range, both ends included (offline, and a 200 on
  both endpoints), and nothing past it: an InvalidRequestError (offline) or a 400 with the OpenAI
  error body naming the field. The caps on lists are inclusive; a value of the wrong type is refused.
- Token ids: stop_token_ids and logit_bias keys from 0 to the vocabulary's last id are served, one
  past either end is a 400 naming the field.
- Effects: top_k, top_p and min_p each alone down to one token give the greedy output; each penalty
  alone changes a repeating greedy output; `stop` as a string is one stop and empty stops stop
  nothing.
- The offline API's output is the whole of its updates: tokens, text, logprobs, prompt logprobs,
  finish reason, and prompt tokens served from the prefix cache.
- --log-requests: every request is still served, and logged in one bounded line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")

from graphserve import LLM, AsyncEngine, EngineConfig, SamplingParams
from graphserve.engine.errors import InvalidRequestError
from graphserve.server.app import create_app
from live_server import BackgroundServer
from tiny_models import make_tiny_model

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # literal: the contract, not the module's constants
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), device="cpu", num_kv_blocks=64)


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[BackgroundServer]:
    config = EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=8, decode_chunk=4, num_kv_blocks=64)
    with BackgroundServer(create_app(AsyncEngine(config), log_requests=True)) as background:  # --log-requests
        background.wait_ready()
        yield background


def error_of(response: httpx.Response, param: str) -> dict[str, Any]:
    """The OpenAI error body of a 400 naming `param`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error


def sampled(oai: openai.OpenAI, model: str, **kw: Any) -> list[str]:
    """The texts of a hot sampled completion (no end of sequence: every choice runs 8 tokens)."""
    response = oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                      extra_body={"ignore_eos": True}, **kw)
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 8 * len(response.choices)
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


# ---- seeds ----------------------------------------------------------------------------------------


def test_every_int64_is_a_seed_that_reproduces_its_output(oai: openai.OpenAI, model: str,
                                                          client: httpx.Client, llm: LLM) -> None:
    """OpenAI and vLLM take any int64 as a seed: both ends, and negative seeds, are served and
    give the same text each time; one past either end is a 400 naming `seed`."""
    for seed in (INT64_MIN, INT64_MIN + 1, -1000, -1, 0, 1000, INT64_MAX):
        first, again = sampled(oai, model, seed=seed), sampled(oai, model, seed=seed)
        assert first == again, seed
    for seed in (INT64_MIN - 1, INT64_MAX + 1):
        error_of(client.post("/v1/completions", json={"prompt": PROMPT, "seed": seed}), "seed")
    for seed in (INT64_MIN, -1000, INT64_MAX):  # the offline API takes the same range
        assert SamplingParams(seed=seed).validate().seed == seed
    for seed in (INT64_MIN - 1, INT64_MAX + 1):
        with pytest.raises(InvalidRequestError) as caught:
            offline(llm, seed=seed)
        assert caught.value.param == "seed"


def test_choice_i_of_a_seeded_request_samples_with_seed_plus_i_wrapping_in_int64(oai: openai.OpenAI,
                                                                                 model: str) -> None:
    """n choices of seed s give the texts of n requests with seeds s, s + 1, ...; past 2**63 - 1
    the seed wraps to -2**63 (int64), so the last seeds are as valid with n > 1 as any."""
    for seed, n in ((INT64_MAX - 1, 3), (-2, 3), (12345, 2)):
        together = sampled(oai, model, seed=seed, n=n)
        wrapped = [(seed + i - INT64_MIN) % 2**64 + INT64_MIN for i in range(n)]
        alone = [sampled(oai, model, seed=s)[0] for s in wrapped]
        assert together == alone, (seed, wrapped)
        assert len(set(together)) == n  # precondition: the seeds draw different texts


# ---- ranges -------------------------------------------------------------------------------------

# (field, values at the ends of its documented range, values just outside it); OpenAI / vLLM ranges,
# with graphserve's caps (temperature and repetition_penalty <= 100, counts fit int32)
RANGES: list[tuple[str, list[Any], list[Any]]] = [
    ("temperature", [0, 0.0, 100, 100.0], [-1e-6, 100.001]),
    ("top_p", [1e-9, 1, 1.0], [0, 0.0, 1.000001, -0.5]),
    ("min_p", [0, 1, 1.0], [-1e-6, 1.000001]),
    ("top_k", [-1, 0, 1, 2**31 - 1], [-2, 2**31]),
    ("min_tokens", [0, 2**31 - 1], [-1, 2**31]),
    ("presence_penalty", [-2, -2.0, 2, 2.0], [-2.001, 2.001]),
    ("frequency_penalty", [-2, -2.0, 2, 2.0], [-2.001, 2.001]),
    ("repetition_penalty", [1e-9, 100, 100.0], [0, 0.0, -1, 100.001]),
    ("logprobs", [0, 20], [-1, 21]),
    ("prompt_logprobs", [0, 20], [-1, 21]),
    ("max_tokens", [1, 2**31 - 1], [-1, 2**31]),
]


def offline(llm: LLM, **kwargs: Any) -> None:
    """Send SamplingParams(**kwargs) through the offline API's edge (LLM.generate validates them
    before anything is queued)."""
    llm.generate([[5, 6, 7]], SamplingParams(**kwargs))


def test_each_parameter_takes_its_whole_range_and_nothing_past_it(llm: LLM) -> None:
    """The offline API takes every value of a parameter's documented range, both ends included,
    and refuses one just past either end with an InvalidRequestError naming the field."""
    for field, valid, invalid in RANGES:
        # max_tokens None (as many as fit) leaves min_tokens as given
        base = {} if field == "max_tokens" else {"max_tokens": None}
        for value in valid:
            assert getattr(SamplingParams(**base, **{field: value}).validate(), field) == value, (field, value)
        for value in invalid:
            with pytest.raises(InvalidRequestError) as caught:
                offline(llm, **base, **{field: value})
            assert caught.value.param == field, (field, value)


def test_the_ends_of_each_range_are_served(client: httpx.Client) -> None:
    """Through the server, every end of a range is a 200 (the engine's own checks agree with the
    protocol's), on both endpoints."""
    chat = [{"role": "user", "content": "Hi"}]
    for field, valid, _ in RANGES:
        if field in ("prompt_logprobs", "max_tokens"):
            continue  # echo's, not a body field; past the context (a 400 context_length_exceeded)
        for value in valid:
            name = "top_logprobs" if field == "logprobs" else field
            completion = {"prompt": PROMPT, "max_tokens": 2, field: value}
            chat_body = {"messages": chat, "max_tokens": 2, name: value}
            if field == "logprobs":
                chat_body["logprobs"] = True
            for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat_body)):
                response = client.post(path, json=body)
                assert response.status_code == 200, (path, field, value, response.text)


def test_list_parameters_take_up_to_their_caps(llm: LLM) -> None:
    """The caps on lists (64 stop strings of at most 512 characters, 256 stop token ids, 1024
    logit_bias entries) are inclusive; one more is an InvalidRequestError naming the field."""
    SamplingParams(stop=["z" * 512] * 64, stop_token_ids=list(range(256)),
                   logit_bias={i: 1.0 for i in range(1024)}).validate()
    for kwargs, param in (
        ({"stop": ["z"] * 65}, "stop"),
        ({"stop": ["z" * 513]}, "stop"),
        ({"stop": "z" * 513}, "stop"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            offline(llm, **kwargs)
        assert caught.value.param == param, kwargs


def test_token_ids_and_biases_take_their_whole_range(llm: LLM) -> None:
    """Token ids (stop_token_ids, logit_bias keys) are integers from 0 up (the engine checks the
    prompt's vocabulary); a bias is a finite number in [-100, 100], as OpenAI's."""
    SamplingParams(stop_token_ids=[0, 2**31 - 1], logit_bias={0: -100, 1: 100.0, 2**31 - 1: 0.5, 3: -100.0}).validate()
    for kwargs, param in (
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {2**31: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 100.001}}, "logit_bias"),
        ({"logit_bias": {5: -100.001}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            offline(llm, **kwargs)
        assert caught.value.param == param, kwargs


def test_a_value_of_the_wrong_type_is_an_error_naming_the_field(llm: LLM) -> None:
    """The offline API refuses what JSON would not carry as the field's type (a bool for a number,
    a float or string for an integer, a string for a number): never silently taken."""
    for kwargs, param in (
        ({"temperature": True}, "temperature"),
        ({"top_p": "0.5"}, "top_p"),
        ({"min_p": None}, "min_p"),
        ({"presence_penalty": False}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": 1.0}, "top_k"),
        ({"min_tokens": "1"}, "min_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"prompt_logprobs": False}, "prompt_logprobs"),
        ({"stop": [1]}, "stop"),
        ({"stop": ["a", b"b"]}, "stop"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: True}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            offline(llm, **kwargs)
        assert caught.value.param == param, kwargs
    for value in (float("inf"), float("-inf"), float("nan")):  # finite numbers only
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            with pytest.raises(InvalidRequestError) as caught:
                offline(llm, **{name: value})
            assert caught.value.param == name, (name, value)


# ---- what each parameter does -----------------------------------------------------------------

TOKEN_PROMPT = [5 + (7 * j) % 250 for j in range(20)]  # 20 ids: a full block of 16 and more


def greedy_ids(llm: LLM, **kw: Any) -> list[int]:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, **kw)
    return llm.generate([TOKEN_PROMPT], params)[0].token_ids


def test_each_filter_given_alone_down_to_one_token_makes_sampling_greedy(llm: LLM) -> None:
    """top_k=1, a tiny top_p and min_p=1, each the only filter of a hot seeded request, keep only
    the most likely token: the output is the greedy one."""
    greedy = greedy_ids(llm)
    hot = dict(max_tokens=16, temperature=2.0, seed=7, ignore_eos=True)
    assert llm.generate([TOKEN_PROMPT], SamplingParams(**hot))[0].token_ids != greedy  # precondition
    for only in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert llm.generate([TOKEN_PROMPT], SamplingParams(**hot, **only))[0].token_ids == greedy, only


def test_each_penalty_given_alone_changes_a_repeating_greedy_output(llm: LLM) -> None:
    """presence_penalty, frequency_penalty and repetition_penalty each act given alone: greedy
    output that repeats a token repeats less (a negative presence penalty: more)."""
    plain = greedy_ids(llm)
    assert len(set(plain)) < len(plain)  # precondition: plain greedy repeats tokens
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert len(set(greedy_ids(llm, **penalty))) > len(set(plain)), penalty
    assert len(set(greedy_ids(llm, presence_penalty=-2.0))) < len(set(plain))
    assert greedy_ids(llm, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0) == plain


def test_a_request_may_end_at_its_first_token_unless_min_tokens_holds_it_off(llm: LLM) -> None:
    """By default (min_tokens 0) a request whose first token is the end of sequence ends there,
    finishing with "stop"; min_tokens=k holds the end off for k tokens."""
    eos = 2  # the tiny model's </s>
    ending = dict(max_tokens=6, temperature=0, logit_bias={eos: 100.0})  # the end is by far the likeliest
    at_once = llm.generate([TOKEN_PROMPT], SamplingParams(**ending))[0]
    assert (at_once.token_ids, at_once.finish_reason) == ([eos], "stop")
    held = llm.generate([TOKEN_PROMPT], SamplingParams(**ending, min_tokens=3))[0]
    assert len(held.token_ids) == 4 and eos not in held.token_ids[:3]
    assert (held.token_ids[3], held.finish_reason) == (eos, "stop")


def test_the_offline_api_returns_the_whole_output_of_every_update(llm: LLM) -> None:
    """A request's output comes in several updates (one per decode round); what `generate` returns
    holds all of it: every token with its text and logprobs, the prompt's logprobs, the finish
    reason, and the prompt tokens served from the prefix cache."""
    params = SamplingParams(max_tokens=21, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = llm.generate([TOKEN_PROMPT], params)[0]
    steps = [u for u in iter_updates(llm, TOKEN_PROMPT, params)]
    assert len(steps) > 2  # precondition: several updates
    assert out.token_ids == [t for u in steps for t in u.token_ids] and len(out.token_ids) == 21
    assert out.text == "".join(u.text for u in steps) == llm.tokenizer.decode(out.token_ids)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(len(lp.top) == 2 for lp in out.logprobs)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(TOKEN_PROMPT)
    assert out.prompt_logprobs[0] is None and all(lp is not None for lp in out.prompt_logprobs[1:])
    assert (out.finished, out.finish_reason, out.stop_reason, out.error) == (True, "length", None, None)
    # the same prompt again, after the first one's full block is cached: the first update says so
    first, again = (llm.generate([TOKEN_PROMPT + [9]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
                    for _ in range(2))
    assert again.num_cached_tokens == 16 and again.token_ids == first.token_ids


def iter_updates(llm: LLM, prompt: list[int], params: SamplingParams):
    """The updates of one request, as the engine gives them."""
    engine = llm.engine
    engine.add_request("updates", prompt, params)
    while engine.has_unfinished():
        yield from engine.step()


def test_stop_as_a_string_is_one_stop_and_empty_stops_stop_nothing(llm: LLM) -> None:
    """`stop` may be one string (OpenAI) and acts as a list holding it; an empty stop string
    matches nothing (it never ends a request at once)."""
    base = dict(max_tokens=16, temperature=0, ignore_eos=True)
    free = llm.generate([TOKEN_PROMPT], SamplingParams(**base))[0]
    stop = next(c for i, c in enumerate(free.text) if i > 0 and c not in free.text[:i])
    assert free.text.index(stop) > 0  # precondition: a character first seen past the start
    as_list, as_string = (llm.generate([TOKEN_PROMPT], SamplingParams(**base, stop=s))[0] for s in ([stop], stop))
    assert (as_string.text, as_string.finish_reason, as_string.stop_reason) == (
        as_list.text, "stop", stop) and as_list.text == free.text[:free.text.index(stop)]
    empty = llm.generate([TOKEN_PROMPT], SamplingParams(**base, stop=["", ""]))[0]
    assert (empty.text, empty.finish_reason) == (free.text, "length")
    assert SamplingParams(stop="").validate().stop == [] and SamplingParams(stop=stop).validate().stop == [stop]


def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(client: httpx.Client) -> None:
    """stop_token_ids and logit_bias keys run from 0 to the vocabulary's last id (258: the tiny
    model's 3 special tokens and 256 bytes): both ends are served, one past either end is a 400
    naming the field; a logit_bias key that is no integer is a 400 too."""
    last = 258
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    forced = [client.post("/v1/completions", json=body | {"logit_bias": {str(t): 100}}) for t in (0, last)]
    assert [r.json()["choices"][0]["token_ids"] for r in forced] == [[0, 0, 0], [last] * 3]
    both = {"stop_token_ids": [0, last], "logit_bias": {"0": -1, str(last): 1}}
    assert client.post("/v1/completions", json=body | both).status_code == 200
    for extra, param in (({"stop_token_ids": [last + 1]}, "stop_token_ids"),
                         ({"logit_bias": {str(last + 1): 1}}, "logit_bias"),
                         ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"1.5": 1}}, "logit_bias"),
                         ({"logit_bias": {"x": 1}}, "logit_bias")):
        error_of(client.post("/v1/completions", json=body | extra), param)


# ---- the request log -------------------------------------------------------------------------------


def test_with_log_requests_every_request_is_served_and_logged_in_one_bounded_line(
        client: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    """--log-requests logs each request's parameters that differ from the defaults, in one line of
    bounded length whatever the request holds (a long grammar, many stop strings), and never
    stands between the request and its answer."""
    long_choice = {"structured_outputs": {"choice": ["yes " * 60, "no " * 60]}}
    many_stops = {"stop": ["s" * 500] * 60, "logit_bias": {str(i): 1 for i in range(200)}}
    with caplog.at_level(logging.INFO, logger="graphserve.server"):
        for extra in (long_choice, many_stops, {"temperature": 0.5, "seed": 3}):
            response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2} | extra)
            assert response.status_code == 200, (extra.keys(), response.text)
    lines = [r.getMessage() for r in caplog.records if "params SamplingParams(" in r.getMessage()]
    assert len(lines) == 3
    params = [line.split("params ", 1)[1] for line in lines]
    assert all(len(p) <= 500 for p in params), [len(p) for p in params]
    assert params[0].startswith("SamplingParams(max_tokens=2, grammar=GrammarSpec(") and "..." in params[0]
    assert "stop=[" in params[1] and "(60 items)" in params[1] and "(500 chars)" in params[1]
    assert params[2] == "SamplingParams(max_tokens=2, temperature=0.5, seed=3)"
