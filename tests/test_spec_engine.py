"""Speculative decoding (n-gram) switched on in the engine (EngineConfig.speculative_method): a
user gets exactly the tokens, text, finish reasons and usage of plain decoding, through the
offline LLM API and through the HTTP server; drafts are really accepted (the counters say so);
requests speculation cannot serve exactly keep their own outputs; no KV block or drafter state
is left behind; a configuration it cannot run is refused with a clear error."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tiny_models import make_tiny_model

from graphserve import LLM, AsyncEngine, EngineConfig, SamplingParams
from graphserve.engine.runner.cuda_graphs import GraphDecoder
from graphserve.engine.structured.grammar import GrammarSpec

K = 4
ENGINE = dict(device="cpu", max_model_len=512, decode_chunk=2, kv_cache_bytes=64 * 1024**2)
SPEC = dict(speculative_method="ngram", num_speculative_tokens=K, speculative_max_batch=64)  # every round speculates
COUNTING = "one two three four five six seven eight nine ten one two three four five six seven eight nine ten one"
CODE = "def square(x):\n    return x * x\n\ndef cube(x):\n    return x * x * x\n\ndef square(x):\n"
ORDINARY = ["The capital of France is", "Q: What is 12 times 12?\nA:"]
COPY_SENTENCE = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."
COPY_LIST = "Repeat this list: red, green, blue, yellow, purple, orange."


def greedy(max_tokens: int = 40, **more) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **more)


def chat(llm: LLM, message: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": message}])


def what_a_user_gets(out) -> tuple:
    return out.token_ids, out.text, out.finish_reason, out.stop_reason


@pytest.fixture(scope="module")
def off() -> LLM:
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def on() -> LLM:
    return LLM(**ENGINE, **SPEC)


@pytest.fixture(scope="module")
def prompts(on: LLM) -> list[str]:
    """Answers that copy from the prompt (drafts accepted) and ordinary ones (mostly rejected)."""
    return [chat(on, COPY_SENTENCE), chat(on, COPY_LIST), COUNTING, CODE, *ORDINARY]


class Verified:
    """What each verify step of an engine gave each sequence: (request id, output position of the
    first token, drafts, tokens returned = accepted drafts + the token after them)."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, list[int], list[int]]] = []

    def of(self, request_id: str) -> list[tuple[int, list[int], list[int]]]:
        return [(pos, drafts, tokens) for rid, pos, drafts, tokens in self.steps if rid == request_id]


@pytest.fixture
def verified(on: LLM, monkeypatch) -> Verified:
    spec = on.engine.core.speculation
    record = Verified()
    real_verify = spec.verify

    def verify(seqs, drafts, graphs=None, device_tokens=None):
        positions = [s.num_output_tokens for s in seqs]
        step = real_verify(seqs, drafts, graphs, device_tokens)
        for seq, pos, proposal in zip(seqs, positions, drafts):
            record.steps.append((seq.request_id, pos, list(proposal), step.tokens[seq.request_id].tokens))
        return step

    monkeypatch.setattr(spec, "verify", verify)
    return record


@pytest.fixture
def leaves_nothing_behind(on: LLM):
    """After the test: every KV block free again, and no drafter state."""
    start = on.engine.block_manager.num_free_blocks
    yield
    assert on.engine.block_manager.num_free_blocks == start
    assert on.engine.core.speculation.num_tracked_requests == 0


def spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats.spec_draft_tokens, stats.spec_accepted_tokens


# ---- the same tokens ----------------------------------------------------------------------------


def test_greedy_batch_gives_plain_greedy_outputs(on, off, prompts, verified, leaves_nothing_behind):
    want = off.generate(prompts, greedy())
    drafted_before, accepted_before = spec_counts(on)
    got = on.generate(prompts, greedy())
    assert [what_a_user_gets(o) for o in got] == [what_a_user_gets(o) for o in want]
    drafted, accepted = spec_counts(on)
    assert 0 < accepted - accepted_before < drafted - drafted_before
    accepted_counts = {len(tokens) - 1 for *_, tokens in verified.steps}
    assert 0 in accepted_counts and K in accepted_counts  # all rejected, all accepted
    copied = verified.of(got[0].request_id)
    assert sum(len(tokens) - 1 for _, _, tokens in copied) >= len(got[0].token_ids) // 2


def test_seeded_sampling_gives_the_same_tokens(on, off, prompts, verified, leaves_nothing_behind):
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=100 + i) for i in range(len(prompts))]
    want = off.generate(prompts, params)
    got = on.generate(prompts, params)
    assert [what_a_user_gets(o) for o in got] == [what_a_user_gets(o) for o in want]
    assert sum(len(tokens) - 1 for *_, tokens in verified.steps) > 0


# ---- a stop inside an accepted draft run ends the request there -------------------------------


def accepted_run(verified: Verified, request_id: str) -> tuple[int, list[int]]:
    """A verify step of the request that accepted at least two drafts: (output position of its
    first token, its tokens)."""
    for pos, _, tokens in verified.of(request_id):
        if len(tokens) >= 3:
            return pos, tokens
    raise AssertionError(f"no verify step of {request_id} accepted two drafts")


def stopped_inside_a_run(verified: Verified, request_id: str, token: int) -> bool:
    """The token came back from a verify step with tokens after it (which the engine dropped)."""
    return any(token in tokens[:-1] for _, _, tokens in verified.of(request_id))


def test_eos_inside_accepted_drafts_ends_the_request_there(on, off, verified, leaves_nothing_behind):
    prompt = chat(on, COPY_SENTENCE)  # the prompt's <|im_end|> follows the sentence the answer copies
    want = off.generate([prompt], greedy())[0]
    got = on.generate([prompt], greedy())[0]
    assert what_a_user_gets(got) == what_a_user_gets(want)
    assert got.finish_reason == "stop" and got.stop_reason is None
    eos = got.token_ids[-1]
    assert eos in on.engine.core.eos_ids
    assert stopped_inside_a_run(verified, got.request_id, eos)


def test_stop_token_id_stop_string_and_max_tokens_inside_accepted_drafts(on, off, verified,
                                                                           leaves_nothing_behind):
    full = on.generate([COUNTING], greedy(24))[0]
    pos, tokens = accepted_run(verified, full.request_id)
    stop_at = pos + 1  # the second token of the run: the first draft it accepted
    stop_token = tokens[1]
    assert full.token_ids.index(stop_token) == stop_at

    by_id = greedy(24, stop_token_ids=[stop_token])
    want, got = off.generate([COUNTING], by_id)[0], on.generate([COUNTING], by_id)[0]
    assert what_a_user_gets(got) == what_a_user_gets(want)
    assert got.token_ids == full.token_ids[:stop_at + 1] and got.stop_reason == stop_token
    assert stopped_inside_a_run(verified, got.request_id, stop_token)

    stop_text = on.tokenizer.decode([stop_token]).strip()
    assert stop_text and stop_text not in on.tokenizer.decode(full.token_ids[:stop_at])
    by_text = greedy(24, stop=[stop_text])
    want, got = off.generate([COUNTING], by_text)[0], on.generate([COUNTING], by_text)[0]
    assert what_a_user_gets(got) == what_a_user_gets(want)
    assert got.finish_reason == "stop" and got.stop_reason == stop_text and stop_text not in got.text
    assert stopped_inside_a_run(verified, got.request_id, stop_token)

    lengths = list(range(2, 12))
    want = off.generate([COUNTING] * len(lengths), [greedy(n) for n in lengths])
    got = on.generate([COUNTING] * len(lengths), [greedy(n) for n in lengths])
    assert [what_a_user_gets(o) for o in got] == [what_a_user_gets(o) for o in want]
    assert [len(o.token_ids) for o in got] == lengths and {o.finish_reason for o in got} == {"length"}


# ---- requests speculation cannot serve exactly ------------------------------------------------


def test_ineligible_requests_keep_their_solo_outputs(on, off, prompts, verified, leaves_nothing_behind):
    schema = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
    ineligible = [
        (COUNTING, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)),
        (COUNTING, greedy(24, presence_penalty=0.5, frequency_penalty=0.3)),
        (CODE, greedy(24, logprobs=2)),
        (chat(on, "Give me a JSON object with a name."), greedy(24, grammar=GrammarSpec("json_schema", schema))),
        (COUNTING, greedy(24, min_tokens=24)),  # eligible only once min_tokens are out: never here
    ]
    solo = [off.generate([p], params)[0] for p, params in ineligible]
    eligible = [COUNTING, chat(on, COPY_LIST)]
    got = on.generate([*eligible, *(p for p, _ in ineligible)],
                      [greedy(24)] * len(eligible) + [params for _, params in ineligible])
    for want, out in zip(solo, got[len(eligible):]):
        assert what_a_user_gets(out) == what_a_user_gets(want)
        if want.logprobs is not None:
            assert [[t for t, _ in lp.top] for lp in out.logprobs] == [[t for t, _ in lp.top] for lp in want.logprobs]
            assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    verified_ids = {rid for rid, *_ in verified.steps}
    assert {o.request_id for o in got[:len(eligible)]} <= verified_ids
    assert not verified_ids & {o.request_id for o in got[len(eligible):]}


# ---- KV blocks under preemption ---------------------------------------------------------------


def test_preempted_speculating_requests_keep_their_tokens_and_free_every_block(tmp_path):
    """A pool too small for the batch (tiny random model): the newest sequences are preempted and
    recomputed while others speculate; the tokens are plain greedy's and every block comes back."""
    model = str(make_tiny_model(tmp_path / "llama", "llama"))
    gen = random.Random(3)
    phrases = [[gen.randrange(3, 259) for _ in range(n)] for n in (3, 5, 4, 6)]
    prompts = [phrase * reps for phrase, reps in zip(phrases, (8, 5, 6, 4))]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = LLM(model, device="cpu", block_size=16, num_kv_blocks=64).generate(prompts, params)
    llm = LLM(model, device="cpu", block_size=16, num_kv_blocks=12, decode_chunk=2, **SPEC)
    start = llm.engine.block_manager.num_free_blocks
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == start
    assert llm.engine.core.speculation.num_tracked_requests == 0


# ---- through the decode graphs (a CUDA engine's path; on CPU the same static rows run eagerly) ----


def with_static_graphs(llm: LLM, max_batch: int = 32) -> LLM:
    core = llm.engine.core
    core.worker.graphs = GraphDecoder(core.worker.runner, max_batch=max_batch, max_steps=core.config.decode_chunk,
                               table_width=-(-core.max_model_len // core.config.block_size), use_cuda_graphs=False)
    core.worker.graphs.capture(progress=False)
    return llm


def test_verify_through_the_decode_graphs_gives_plain_outputs(off, prompts, monkeypatch):
    """A speculating engine with decode graphs verifies through them (one decode step of B x (k + 1)
    rows) and gives plain decoding's greedy and seeded tokens, freeing every block."""
    llm = with_static_graphs(LLM(**ENGINE, **SPEC))
    graphs = llm.engine.core.worker.graphs
    calls = []
    real = graphs.verify_logits
    monkeypatch.setattr(graphs, "verify_logits", lambda seqs, drafts, k, *more: calls.append(len(seqs)) or real(seqs, drafts, k, *more))
    start = llm.engine.block_manager.num_free_blocks
    for params in (greedy(), [SamplingParams(max_tokens=32, temperature=0.8, seed=100 + i) for i in range(len(prompts))]):
        want, got = off.generate(prompts, params), llm.generate(prompts, params)
        assert [what_a_user_gets(o) for o in got] == [what_a_user_gets(o) for o in want]
    assert calls and max(calls) > 1
    assert spec_counts(llm)[1] > 0
    assert llm.engine.block_manager.num_free_blocks == start
    assert llm.engine.core.speculation.num_tracked_requests == 0


def test_rounds_over_the_speculative_max_batch_decode_ahead_without_drafts(off, prompts):
    """speculative_max_batch 2: while more sequences run, rounds are launched ahead (overlap) and
    nothing is drafted; once two or fewer are left they speculate. Plain greedy's tokens throughout."""
    llm = with_static_graphs(LLM(**ENGINE, **{**SPEC, "speculative_max_batch": 2}, overlap_rounds=True))
    lengths = [8, 12, 40, 48, 16, 20]
    params = [greedy(n) for n in lengths]
    want, got = off.generate(prompts, params), llm.generate(prompts, params)
    assert [what_a_user_gets(o) for o in got] == [what_a_user_gets(o) for o in want]
    stats = llm.engine.stats()
    assert stats.decode_rounds_ahead > 0 and stats.spec_accepted_tokens > 0
    # only the two longest requests ever speculated
    assert stats.spec_verify_rows <= (48 - 20) + (40 - 20)
    # on CPU the default is 8 (speculation's gain fades with the batch: engine/spec/speculative_decoder.py)
    default = LLM(**ENGINE, speculative_method="ngram").engine.core.speculation
    assert default.applies(8) and not default.applies(9)


# ---- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad, message", [
    (dict(num_speculative_tokens=0), r"num_speculative_tokens must be in \[1, 16\], got 0"),
    (dict(num_speculative_tokens=17), r"num_speculative_tokens must be in \[1, 16\], got 17"),
    (dict(speculative_method="eagle"), r"speculative_method must be ngram .*'eagle'"),
    (dict(speculative_method="ngram", tensor_parallel_size=2), "tensor parallelism"),
    (dict(speculative_max_batch=0), "speculative_max_batch must be >= 1, got 0"),
])
def test_a_bad_speculation_setting_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**bad)


def test_the_cli_takes_the_flags_and_refuses_bad_values(capsys):
    from graphserve.server import cli

    args = cli.build_parser().parse_args(["serve", "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                                          "--speculative-max-batch", "16"])
    _, config, _ = cli.load_settings(args)
    assert (config.speculative_method, config.num_speculative_tokens, config.speculative_max_batch) == ("ngram", 3, 16)
    assert cli.main(["generate", "hi", "--speculative-method", "medusa"]) == 2
    assert "speculative_method must be ngram" in capsys.readouterr().err


# ---- through the HTTP server and the openai client --------------------------------------------


def test_http_server_gives_plain_outputs_streamed_and_not(off, prompts):
    httpx = pytest.importorskip("httpx", reason="httpx (a dev extra) drives the HTTP server")
    openai = pytest.importorskip("openai", reason="the openai client (a dev extra) drives the HTTP server")
    from graphserve.server.app import create_app
    from live_server import BackgroundServer

    def completion_texts(oai, model, prompt_ids, stream, **body):
        if not stream:
            result = oai.completions.create(model=model, prompt=prompt_ids, stream=False, **body)
            return result.choices[0].text, result.choices[0].finish_reason, result.usage.completion_tokens
        text, finish, usage = "", None, None
        for chunk in oai.completions.create(model=model, prompt=prompt_ids, stream=True,
                                            stream_options={"include_usage": True}, **body):
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return text, finish, usage

    prompt_ids = [off.tokenizer.encode(p) for p in prompts]
    want = off.generate(prompt_ids, greedy(32))
    stopped = off.generate([COUNTING], greedy(32, stop=["four"]))[0]
    config = EngineConfig(model=None, **ENGINE, **SPEC)
    with BackgroundServer(create_app(AsyncEngine(config))) as server:
        server.wait_ready()
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
        model = oai.models.list().data[0].id
        for stream in (False, True):
            with ThreadPoolExecutor(len(prompt_ids)) as pool:  # concurrent: they share verify steps
                got = list(pool.map(lambda ids: completion_texts(oai, model, ids, stream, max_tokens=32,
                                                                 temperature=0), prompt_ids))
            assert got == [(o.text, o.finish_reason, len(o.token_ids)) for o in want], f"stream={stream}"
            text, finish, usage = completion_texts(oai, model, off.tokenizer.encode(COUNTING), stream, max_tokens=32,
                                                   temperature=0, stop=["four"])
            assert (text, finish, usage) == (stopped.text, "stop", len(stopped.token_ids))
        reply = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": COPY_SENTENCE}],
                                            max_tokens=32, temperature=0)
        plain = off.generate([chat(off, COPY_SENTENCE)], greedy(32))[0]
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (plain.text, "stop")
        assert reply.usage.completion_tokens == len(plain.token_ids)

        with httpx.Client(base_url=server.url, timeout=30.0) as http:
            deadline = time.monotonic() + 10
            while True:  # the core sends its counters every 0.1 s
                metrics = scrape(http)
                if metrics["graphserve_kv_blocks_free"] == metrics["graphserve_kv_blocks_total"]:
                    break
                assert time.monotonic() < deadline, "KV blocks still in use after every request ended"
                time.sleep(0.05)
        assert 0 < metrics["graphserve_spec_accepted_tokens_total"] < metrics["graphserve_spec_draft_tokens_total"]
        assert metrics["graphserve_spec_verify_rows_total"] > 0


def scrape(http) -> dict[str, float]:
    metrics = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("graphserve_") and " " in line:
            name, value = line.rsplit(" ", 1)
            metrics[name] = float(value)
    return metrics


# ---- soak: arrivals, aborts, preemption and rejections leave no block behind ------------------


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_speculating_soak_leaves_no_block_or_drafter_state_behind(tmp_path, method):
    """300 requests arriving over time into a pool too small for them (preemptions), a tenth aborted
    mid-flight, greedy, seeded and ineligible ones mixed, prompts that repeat themselves (drafts
    accepted) and random ones (rejected): every request that ran to its end got plain decoding's
    tokens, and afterwards every KV block of both pools is free and no drafter holds a request."""
    model = make_tiny_model(tmp_path / "llama", "llama")
    spec = dict(speculative_method=method, num_speculative_tokens=K, speculative_max_batch=64)
    if method == "draft":
        spec["draft_model"] = str(make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1))
    engine_args = dict(device="cpu", num_kv_blocks=40, block_size=16, decode_chunk=2, max_model_len=128,
                       max_num_seqs=16)
    gen = random.Random(7)
    requests = []
    for i in range(300):
        base = [gen.randrange(3, 259) for _ in range(gen.randrange(2, 9))]
        prompt = (base * 12)[:gen.randrange(8, 60)] if i % 2 else [gen.randrange(3, 259) for _ in range(20)]
        kind = i % 5
        params = (SamplingParams(max_tokens=gen.randrange(1, 48), temperature=0.9, seed=i) if kind == 1 else
                  SamplingParams(max_tokens=24, temperature=0, presence_penalty=0.4) if kind == 2 else
                  SamplingParams(max_tokens=gen.randrange(1, 48), temperature=0, ignore_eos=True))
        requests.append((f"r{i}", prompt, params, gen.random() < 0.1))
    plain = LLM(str(model), **engine_args)
    want = [o.token_ids for o in plain.generate([p for _, p, _, _ in requests], [params for _, _, params, _ in requests])]

    llm = LLM(str(model), **engine_args, **spec)
    engine, core = llm.engine, llm.engine.core
    free, draft_free = engine.block_manager.num_free_blocks, None
    if method == "draft":
        draft_free = core.speculation.drafter.blocks.num_free_blocks
    got: dict[str, list[int]] = {}
    pending, steps, aborted, done = list(requests), 0, set(), set()
    while pending or engine.has_unfinished():
        for _ in range(gen.randrange(0, 4)):  # arrivals between steps
            if pending:
                rid, prompt, params, _ = pending.pop(0)
                engine.add_request(rid, prompt, params)
        for rid, _, _, abort in requests:
            if abort and rid not in aborted and rid not in done and rid in core.sequences and gen.random() < 0.3:
                engine.abort(rid)
                aborted.add(rid)
        for out in engine.step():  # each update carries the tokens new since the last
            got.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                done.add(out.request_id)
        steps += 1
        assert steps < 20000
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens  # rejections happened
    assert len(aborted) > 10 and len(done) == len(requests) - len(aborted)
    for (rid, *_), tokens in zip(requests, want):
        if rid not in aborted:
            assert got[rid] == tokens, rid
    assert engine.block_manager.num_free_blocks == free
    assert core.speculation.num_tracked_requests == 0
    if method == "draft":
        assert core.speculation.drafter.blocks.num_free_blocks == draft_free
        assert core.speculation.drafter.num_tracked_requests == 0
