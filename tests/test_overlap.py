"""Overlapped decode rounds (EngineConfig.overlap_rounds): the next round is launched
before the host reads the current one. What users see must not change: the same tokens
and finish reasons as one round at a time and as the plain eager path, whatever ends a
request (length, EOS, stop string, abort) and wherever in a round it ends. On CPU the
graph decoder runs its static-buffer path eagerly; the gpu test replays real graphs."""

import json

import pytest
import torch

from graphserve import LLM, SamplingParams
from graphserve.engine.runner.cuda_graphs import GraphDecoder
from tiny_models import make_tiny_model

K = 4  # decode_chunk: a request's first token comes from its prefill, so rounds end at 1 + 4r tokens
PROMPTS = [[5 + (13 * i + j) % 250 for j in range(n)] for i, n in enumerate((3, 17, 30, 8, 50, 1, 23, 12))]
# max_tokens per prompt: 9 and 13 end on a round boundary, 1 in the prefill, 7 and 22 inside a round
MAX_TOKENS = [9, 1, 7, 13, 22]
SEEDED = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2")


def make_llm(model_dir, mode: str, **kw) -> LLM:
    """mode: "eager" (no graph decoder), "serial" (graph decoder, one round at a time) or "overlap"."""
    kw.setdefault("num_kv_blocks", 96)
    llm = LLM(str(model_dir), device="cpu", decode_chunk=K, overlap_rounds=mode == "overlap", **kw)
    if mode != "eager":
        engine = llm.engine.core
        engine.worker.graphs = GraphDecoder(engine.worker.runner, max_batch=8, max_steps=K,
                                     table_width=-(-engine.max_model_len // engine.config.block_size),
                                     use_cuda_graphs=False)
        engine.worker.graphs.capture(progress=False)
    return llm


def params_for(kind: str, max_tokens: int, **kw) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)
    return SamplingParams(max_tokens=max_tokens, seed=17 * max_tokens, **SEEDED, **kw)


def generate(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    outs = llm.generate(prompts, params)
    assert engine.block_manager.num_free_blocks == free
    assert not engine.has_unfinished()
    return [(o.token_ids, o.finish_reason) for o in outs]


def merge_into(seen: dict, out) -> None:
    """Add an update to its request's whole output in `seen`."""
    if out.request_id in seen:
        seen[out.request_id].merge(out)
    else:
        seen[out.request_id] = out


def run_by_hand(engine) -> dict:
    """Step until nothing is left; each request's updates merged into its whole output."""
    seen: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            merge_into(seen, out)
    return seen


@pytest.fixture(scope="module")
def engines(model_dir):
    return {mode: make_llm(model_dir, mode) for mode in ("eager", "serial", "overlap")}


@pytest.fixture(autouse=True)
def nothing_left(request):
    """After each test every shared engine is idle with all its KV blocks back in the pool."""
    yield
    if "engines" in request.fixturenames:
        for llm in request.getfixturevalue("engines").values():
            stats = llm.engine.stats()
            assert not llm.engine.has_unfinished()
            assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_same_tokens_with_and_without_overlap(engines, kind, batch):
    params = [params_for(kind, n, ignore_eos=True) for n in MAX_TOKENS[:batch]]
    prompts = PROMPTS[:batch]
    ahead = engines["overlap"].engine.stats().decode_rounds_ahead
    want = generate(engines["eager"], prompts, params)
    assert [len(t) for t, _ in want] == MAX_TOKENS[:batch]
    assert generate(engines["serial"], prompts, params) == want
    assert generate(engines["overlap"], prompts, params) == want
    assert engines["overlap"].engine.stats().decode_rounds_ahead > ahead
    assert engines["serial"].engine.stats().decode_rounds_ahead == 0


def test_overlap_counts_rounds_and_tokens_like_serial(engines):
    params = [params_for("greedy", n, ignore_eos=True) for n in MAX_TOKENS]
    before = {m: engines[m].engine.stats() for m in ("serial", "overlap")}
    generate(engines["serial"], PROMPTS[:5], params)
    generate(engines["overlap"], PROMPTS[:5], params)
    after = {m: engines[m].engine.stats() for m in ("serial", "overlap")}
    delta = {m: (after[m].decode_rounds - before[m].decode_rounds,
                 after[m].generation_tokens - before[m].generation_tokens,
                 sum(after[m].graph_replays.values()) - sum(before[m].graph_replays.values()))
             for m in after}
    assert delta["overlap"][1] == delta["serial"][1] == sum(MAX_TOKENS)
    # overlap rounds may cover a little more (rounds whose request stopped inside the round before)
    assert delta["overlap"][0] >= delta["serial"][0] and delta["overlap"][2] >= delta["serial"][2]


def eos_model(model_dir, path, kind: str):
    """The tiny model with, as its EOS, a token that PROMPTS[0] first generates inside a
    decode round (not at its end): requests that do not ignore EOS then stop there."""
    import shutil

    tokens = make_llm(model_dir, "eager").generate([PROMPTS[0]], params_for(kind, 30, ignore_eos=True))[0].token_ids
    eos = next(t for i, t in enumerate(tokens) if i > K and i % K and t not in tokens[:i])
    shutil.copytree(model_dir, path)
    for name in ("config.json", "generation_config.json"):  # the engine reads EOS ids from both
        if (path / name).is_file():
            config = json.loads((path / name).read_text())
            config["eos_token_id"] = eos
            (path / name).write_text(json.dumps(config))
    return path, tokens.index(eos) + 1


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_eos_inside_a_round_drops_the_tokens_in_flight(model_dir, tmp_path, kind):
    path, first_len = eos_model(model_dir, tmp_path / "eos", kind)
    params = [params_for(kind, 30) for _ in range(5)]
    want = generate(make_llm(path, "eager"), PROMPTS[:5], params)
    assert want[0][1] == "stop" and len(want[0][0]) == first_len
    assert generate(make_llm(path, "serial"), PROMPTS[:5], params) == want
    overlap = make_llm(path, "overlap")
    assert generate(overlap, PROMPTS[:5], params) == want
    assert overlap.engine.stats().decode_rounds_ahead > 0


def test_stop_string(engines):
    free = engines["eager"].generate([PROMPTS[4]], params_for("greedy", 24, ignore_eos=True))[0]
    stop = free.text[7:10]
    params = params_for("greedy", 24, ignore_eos=True, stop=[stop])
    want = engines["eager"].generate([PROMPTS[4], PROMPTS[1]], params)
    assert want[0].finish_reason == "stop" and want[0].text == free.text[:free.text.index(stop)]
    for mode in ("serial", "overlap"):
        got = engines[mode].generate([PROMPTS[4], PROMPTS[1]], params)
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in got] == \
               [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in want]
        assert not engines[mode].engine.has_unfinished()


def _start_two(engine, max_tokens: int = 30):
    """Two requests through their prefill and one decode round (their first 1 + K tokens,
    not seen by run_by_hand after it); the next round is left in flight."""
    params = params_for("greedy", max_tokens, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    outs = engine.step()  # prefill
    assert {o.request_id: len(o.token_ids) for o in outs} == {"a": 1, "b": 1}
    ahead = engine.stats().decode_rounds_ahead
    outs = engine.step()
    assert {o.request_id: len(o.token_ids) for o in outs} == {"a": K, "b": K}
    assert engine.stats().decode_rounds_ahead == ahead + 1  # a round is in flight
    return params


def test_abort_while_a_round_is_in_flight(engines):
    engine = engines["overlap"].engine
    free = engine.block_manager.num_free_blocks
    params = _start_two(engine)
    engine.abort("a")
    assert "a" not in engine.core.sequences and "a" not in engine.outputs.states
    assert engine.has_unfinished()
    seen = run_by_hand(engine)
    assert "a" not in seen
    want = engines["eager"].generate([PROMPTS[1]], params)[0].token_ids
    assert seen["b"].token_ids == want[1 + K:] and seen["b"].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == free


def test_abort_everything_while_a_round_is_in_flight(engines):
    engine = engines["overlap"].engine
    free = engine.block_manager.num_free_blocks
    _start_two(engine)
    engine.abort("a")
    assert engine.has_unfinished()
    engine.abort("b")
    assert not engine.has_unfinished()  # nobody waits for the round in flight
    assert engine.step() == []
    assert engine.block_manager.num_free_blocks == free


def test_request_added_while_a_round_is_in_flight(engines):
    engine = engines["overlap"].engine
    free = engine.block_manager.num_free_blocks
    params = _start_two(engine, max_tokens=25)
    late = params_for("seeded", 11, ignore_eos=True)
    engine.add_request("c", PROMPTS[2], late)
    seen = run_by_hand(engine)
    eager = engines["eager"]
    assert seen["a"].token_ids == eager.generate([PROMPTS[0]], params)[0].token_ids[1 + K:]
    assert seen["b"].token_ids == eager.generate([PROMPTS[1]], params)[0].token_ids[1 + K:]
    assert seen["c"].token_ids == eager.generate([PROMPTS[2]], late)[0].token_ids
    assert engine.block_manager.num_free_blocks == free


def test_failed_round_in_flight_fails_only_its_requests(engines):
    engine = engines["overlap"].engine
    free = engine.block_manager.num_free_blocks
    _start_two(engine)
    engine.inject_fault("step")  # the round launched next fails, and so does each request on its own
    seen = run_by_hand(engine)
    assert sorted((r, o.finish_reason) for r, o in seen.items()) == [("a", "error"), ("b", "error")]
    assert engine.block_manager.num_free_blocks == free
    params = params_for("greedy", 10, ignore_eos=True)
    assert generate(engines["overlap"], PROMPTS[:2], params) == generate(engines["eager"], PROMPTS[:2], params)


def test_preemption_with_overlap(model_dir, engines):
    params = params_for("greedy", 24, ignore_eos=True)
    want = generate(engines["eager"], PROMPTS, params)
    # 12 usable blocks of 16 tokens cannot hold 8 sequences of up to 74 tokens
    small = make_llm(model_dir, "overlap", num_kv_blocks=13)
    assert generate(small, PROMPTS, params) == want
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.decode_rounds_ahead > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_overlap_on_cuda_graphs(model_dir, kind):
    """Real graphs, pinned host buffers and events: overlap on, off and eager agree."""
    params = [params_for(kind, n, ignore_eos=True) for n in (9, 1, 7, 13, 22, 30, 5, 17)]
    results = {}
    for name, kw in (("eager", {"enforce_eager": True}), ("serial", {"overlap_rounds": False}), ("overlap", {})):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", decode_chunk=K, num_kv_blocks=96, **kw)
        results[name] = [generate(llm, PROMPTS[:n], params[:n]) for n in (1, 3, 8)]
        if name == "overlap":
            assert llm.engine.stats().decode_rounds_ahead > 0
        del llm
        torch.cuda.empty_cache()
    assert results["overlap"] == results["serial"] == results["eager"]


def test_the_pipeline_survives_turnover(engines):
    """Requests ending (max_tokens) and arriving while rounds are in flight: the round after
    each one is still launched ahead (for the requests that go on plus the new ones,
    prefilled behind the round in flight), and every request's tokens equal eager's."""
    engine = engines["overlap"].engine
    lengths = {"t0": 9, "t1": 17, "t2": 30, "t3": 12, "t4": 21, "t5": 26}
    params = {rid: params_for("seeded", n, ignore_eos=True) for rid, n in lengths.items()}
    before = engine.stats()
    for rid in ("t0", "t1", "t2"):
        engine.add_request(rid, PROMPTS[int(rid[1])], params[rid])
    seen: dict = {}
    arrivals = iter(("t3", "t4", "t5"))
    while engine.has_unfinished():
        for out in engine.step():
            merge_into(seen, out)
            if out.finished:  # one leaves, the next arrives while a round is in flight
                late = next(arrivals, None)
                if late is not None:
                    engine.add_request(late, PROMPTS[int(late[1]) % len(PROMPTS)], params[late])
    after = engine.stats()
    eager = engines["eager"]
    for rid, n in lengths.items():
        want = eager.generate([PROMPTS[int(rid[1]) % len(PROMPTS)]], params[rid])[0]
        assert seen[rid].token_ids == want.token_ids and len(want.token_ids) == n
    rounds = after.decode_rounds - before.decode_rounds
    ahead = after.decode_rounds_ahead - before.decode_rounds_ahead
    # only the first round (nothing in flight yet) and a round after the batch emptied start cold
    assert ahead >= rounds - 2, (ahead, rounds)


def test_a_request_prefilled_behind_a_round_in_flight_joins_the_next_rounds(engines):
    """A short request arriving while a long one's rounds are in flight is prefilled behind the
    round in flight and decodes in the rounds launched after it: it is not held back until the
    long request ends, so it finishes first. Both get eager's tokens."""
    engine = engines["overlap"].engine
    long, short = params_for("greedy", 60, ignore_eos=True), params_for("greedy", 6, ignore_eos=True)
    engine.add_request("long", PROMPTS[0], long)
    seen: dict = {}
    for _ in range(2):  # its prefill, then its first round collected with the next one in flight
        for out in engine.step():
            merge_into(seen, out)
    engine.add_request("short", PROMPTS[1], short)
    finished = []
    try:
        while engine.has_unfinished():
            for out in engine.step():
                merge_into(seen, out)
                if out.finished:
                    finished.append(out.request_id)
    finally:  # a failure leaves the shared engine idle for the next tests
        for rid in ("long", "short"):
            engine.abort(rid)
    assert finished == ["short", "long"]
    eager = engines["eager"]
    assert seen["long"].token_ids == eager.generate([PROMPTS[0]], long)[0].token_ids
    assert seen["short"].token_ids == eager.generate([PROMPTS[1]], short)[0].token_ids


@pytest.mark.parametrize("lengths", [[9], MAX_TOKENS], ids=["one", "five"])
def test_overlap_runs_no_step_for_a_request_ending_by_length_in_the_round_in_flight(engines, lengths):
    """A request that reaches max_tokens inside (or at the end of) the round in flight is known
    to end there: the round launched ahead leaves it out, so the device runs exactly the decode
    steps of one round at a time (graph replays per batch size), not one more."""
    params = [params_for("greedy", n, ignore_eos=True) for n in lengths]
    work = {}
    for mode in ("serial", "overlap"):
        before = engines[mode].engine.stats()
        assert [len(t) for t, _ in generate(engines[mode], PROMPTS[:len(lengths)], params)] == lengths
        after = engines[mode].engine.stats()
        work[mode] = {bucket: n - before.graph_replays.get(bucket, 0) for bucket, n in after.graph_replays.items()
                      if n != before.graph_replays.get(bucket, 0)}
    assert work["overlap"] == work["serial"]


@pytest.mark.parametrize("lengths", [[6, 30], MAX_TOKENS], ids=["two", "five"])
def test_overlap_sends_each_request_its_tokens_in_the_same_steps_as_serial(engines, lengths):
    """Rounds launched ahead change when the host reads a round, not what each step hands each
    request: step by step, every request gets the same tokens with and without overlap (a request
    with one token left after the round in flight gets it from the round launched next)."""
    params = [params_for("greedy", n, ignore_eos=True) for n in lengths]
    steps = {}
    ahead = engines["overlap"].engine.stats().decode_rounds_ahead
    for mode in ("serial", "overlap"):
        engine = engines[mode].engine
        for i, p in enumerate(params):
            engine.add_request(f"s{i}", PROMPTS[i], p)
        steps[mode] = []
        try:
            while engine.has_unfinished():
                steps[mode].append(sorted((o.request_id, o.token_ids, o.finish_reason) for o in engine.step()))
        finally:  # a failure leaves the shared engine idle for the next tests
            for i in range(len(params)):
                engine.abort(f"s{i}")
    assert steps["overlap"] == steps["serial"]
    assert engines["overlap"].engine.stats().decode_rounds_ahead > ahead
