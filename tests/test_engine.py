"""Engine behaviour on a tiny random model: batching, preemption, block accounting,
sampling controls, bad input."""

import pytest
import torch
import transformers

from graphserve import LLM, SamplingParams
from graphserve.engine.errors import InvalidRequestError, ModelFilesError, PromptTooLongError, UnsupportedModelError
from tiny_models import make_tiny_model

PROMPTS = [[5 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((3, 17, 30, 8, 50, 1, 23, 12))]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def make_llm(model_dir, **kw):
    kw.setdefault("num_kv_blocks", 96)
    return LLM(str(model_dir), device="cpu", **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


@pytest.fixture(autouse=True)
def blocks_return(request):
    """Every KV block handed out during a test is back in the pool at its end."""
    engines = [request.getfixturevalue("llm").engine] if "llm" in request.fixturenames else []
    start = [e.block_manager.num_free_blocks for e in engines]
    yield
    assert [e.block_manager.num_free_blocks for e in engines] == start


@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in PROMPTS:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


def test_batch_greedy_matches_transformers(llm, hf_greedy):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy
    assert all(o.finish_reason == "length" for o in outs)


def test_alone_together_and_preempted_give_same_tokens(model_dir, llm, hf_greedy):
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert alone == hf_greedy
    # 12 usable blocks of 16 tokens cannot hold 8 sequences of up to 74 tokens: preemption must happen
    small = make_llm(model_dir, num_kv_blocks=13, decode_chunk=4)
    start = small.engine.block_manager.num_free_blocks
    outs = small.generate(PROMPTS, GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == hf_greedy
    assert small.engine.block_manager.num_free_blocks == start


@pytest.mark.parametrize("decode_chunk", [1, 3, 8])
def test_decode_chunk_does_not_change_tokens(model_dir, hf_greedy, decode_chunk):
    llm = make_llm(model_dir, decode_chunk=decode_chunk)
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], GREEDY)] == hf_greedy[:4]


@pytest.mark.parametrize("budget", [1, 7])
def test_chunked_prefill_gives_same_tokens(model_dir, hf_greedy, budget):
    llm = make_llm(model_dir, max_num_batched_tokens=budget)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy


def merge_updates(seen: dict, updates) -> None:
    """Each request's updates so far merged into one output (by request id)."""
    for out in updates:
        if out.request_id in seen:
            seen[out.request_id].merge(out)
        else:
            seen[out.request_id] = out


def arrive_late(engine, core) -> list:
    """A request ("late") arrives between two steps of the next round, as CoreLoop takes what came
    in while a round runs; the list holds its id once it has."""
    arrived = []

    def arrive(outputs):
        if not arrived:
            arrived.append(engine.add_request("late", PROMPTS[1], GREEDY))

    core.on_wait = arrive
    return arrived


def test_decodes_riding_along_prefill_steps_keep_their_tokens(model_dir, hf_greedy):
    """On CPU the running decodes join each prefill step with one token: greedy tokens stay
    transformers', seeded samples stay those of separate steps, and the prompt-token count
    leaves the riders out."""
    llm = make_llm(model_dir, max_num_batched_tokens=7, max_num_seqs=3)
    core = llm.engine.core
    assert core.scheduler.mix_decodes
    seen = []
    run = core.worker.runner.prefill

    def spy(batch, **kw):
        seen.append(batch.num_decodes)
        return run(batch, **kw)

    core.worker.runner.prefill = spy
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy
        assert core.stats().prompt_tokens == sum(map(len, PROMPTS))  # the riders' tokens are not prompt tokens
        sampled = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
        with_riders = [o.token_ids for o in llm.generate(PROMPTS, sampled)]
    finally:
        core.worker.runner.prefill = run
    assert max(seen) > 0  # decodes did ride along
    core.scheduler.mix_decodes = False
    assert [o.token_ids for o in llm.generate(PROMPTS, sampled)] == with_riders


def test_a_request_arriving_during_a_cpu_round_waits_one_step_not_the_round(model_dir, hf_greedy):
    """Serving on a CPU, a decode round runs synchronously and the core takes new requests
    between its steps (on_wait): one that arrives ends the round after the step in progress,
    so its first token waits for one decode step of the running requests, not for all K
    (issue 43: in a closed loop each new request arrives just after a round has started).
    Both requests' tokens stay the same."""
    llm = make_llm(model_dir, decode_chunk=8)
    engine, core = llm.engine, llm.engine.core
    engine.add_request("running", PROMPTS[4], GREEDY)
    updates = engine.step()  # its prefill
    arrived = arrive_late(engine, core)
    try:
        cut = engine.step()
        assert [(u.request_id, len(u.token_ids)) for u in cut] == [("running", 1)]  # one step of the 8
        after = engine.step()
        assert [len(u.token_ids) for u in after if u.request_id == "late"] == [1]  # its prefill came next
        updates += cut + after
        while engine.has_unfinished():
            updates += engine.step()
    finally:
        core.on_wait = None
    for rid, i in (("running", 4), ("late", 1)):
        assert [t for u in updates if u.request_id == rid for t in u.token_ids] == hf_greedy[i]


def test_max_num_seqs_limits_the_batch(model_dir, hf_greedy):
    llm = make_llm(model_dir, max_num_seqs=2)
    seen = []
    real_decode = llm.engine.runner.decode
    llm.engine.runner.decode = lambda rnd, **kw: seen.append(len(rnd.seqs)) or real_decode(rnd, **kw)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy
    assert max(seen) == 2


def test_seeded_sampling_independent_of_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    mixed = llm.generate(PROMPTS[:4], [GREEDY, params, SamplingParams(max_tokens=5, temperature=1.0), GREEDY])
    assert mixed[1].token_ids == alone
    other_seed = llm.generate([PROMPTS[1]], SamplingParams(**{**vars(params), "seed": 99}))[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llm, hf_greedy):
    params = SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    assert llm.generate([PROMPTS[2]], params)[0].token_ids == hf_greedy[2]


def test_sampling_follows_the_distribution(llm):
    """Token frequencies over many seeds track softmax(logits / T). The tiny model's logits are
    nearly flat, so a low T is what gives the top token a share a wrong T would visibly change
    (the top token: 18% at T=0.05, 4% at T=0.1, 0.2% at T=2)."""
    prompt = PROMPTS[3]
    params = [SamplingParams(max_tokens=1, temperature=0.05, seed=s) for s in range(400)]
    counts = torch.zeros(512)
    for o in llm.generate([prompt] * 400, params):
        counts[o.token_ids[0]] += 1
    engine = llm.engine.core
    logits = _next_token_logits(engine, prompt)
    probs = (logits / 0.05).softmax(-1)
    top = probs.argmax()
    assert abs(counts[top] / 400 - probs[top]) < 0.06
    assert (counts > 0).sum() > 20  # really random


def _next_token_logits(engine, prompt):
    from graphserve.engine.models.attention import AttentionMetadata
    from graphserve.engine.sched.kv_cache import allocate_kv_cache

    kv = allocate_kv_cache(engine.args, 8, 16, torch.float32, torch.device("cpu"))
    n = len(prompt)
    meta = AttentionMetadata(True, torch.arange(16, 16 + n), torch.tensor([[1, 2, 3, 4]], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), n, [n], [n])
    with torch.no_grad():
        return engine.worker.model.compute_logits(engine.worker.model(torch.tensor(prompt), torch.arange(n), meta, kv))[-1]


def test_stop_token_ids_and_eos(llm, hf_greedy):
    target = hf_greedy[0][5]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[target]))[0]
    first = hf_greedy[0].index(target)
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == hf_greedy[0][:first + 1]
    # min_tokens bans the stop token for the first tokens
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[target],
                                                    min_tokens=first + 1))[0]
    assert target not in out.token_ids[:first + 1] and len(out.token_ids) > first


def test_stop_string_trims_text_and_tokens(llm):
    free = llm.generate([PROMPTS[4]], GREEDY)[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    first = text.index(stop)
    out = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:first]
    assert len(out.token_ids) < len(free.token_ids)
    kept = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True))[0]
    assert kept.text == text[:first + len(stop)]


def test_logit_bias_forces_a_token(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                    logit_bias={77: 100.0}))[0]
    assert out.token_ids == [77] * 6


def test_repetition_penalties_change_greedy_output(llm, hf_greedy):
    assert torch.bincount(torch.tensor(hf_greedy[0])).max() > 1  # precondition: plain greedy repeats a token
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                    frequency_penalty=2.0))[0]
    counts = torch.bincount(torch.tensor(out.token_ids))
    assert counts.max() <= torch.bincount(torch.tensor(hf_greedy[0])).max()
    assert out.token_ids != hf_greedy[0] or counts.max() == 1


def test_logprobs_greedy_token_is_top1(llm):
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 8
    for lp in out.logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0


def test_prompt_logprobs_with_zero_max_tokens(llm):
    prompt = PROMPTS[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    logits = _next_token_logits(llm.engine.core, prompt[:10])
    expected = logits.log_softmax(-1)[prompt[10]].item()
    assert out.prompt_logprobs[10].logprob == pytest.approx(expected, abs=1e-4)


def test_incremental_text_equals_full_decode(llm):
    tok = llm.tokenizer
    outs = llm.generate(PROMPTS, GREEDY)
    for o in outs:
        assert o.text == tok.decode(o.token_ids)


def test_bad_input_errors(model_dir, llm, tmp_path):
    with pytest.raises(PromptTooLongError, match="maximum context length is 512"):
        llm.generate([[5] * 500], SamplingParams(max_tokens=20))
    with pytest.raises(PromptTooLongError):
        llm.generate([[5] * 600], SamplingParams(max_tokens=None))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate([[5]], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="temperature"):
        llm.generate([[5]], SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], SamplingParams())
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[5, 100000]], SamplingParams())
    with pytest.raises(ModelFilesError, match="not found"):
        LLM(str(tmp_path / "nope"), device="cpu")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(tmp_path / "bad"), device="cpu")
    import shutil

    shutil.copytree(model_dir, tmp_path / "noweights")
    (tmp_path / "noweights" / "model.safetensors").unlink()
    with pytest.raises(ModelFilesError, match="safetensors"):
        LLM(str(tmp_path / "noweights"), device="cpu")
    assert llm.engine.scheduler.running == [] and not llm.engine.scheduler.waiting


def test_failed_step_fails_only_its_requests(llm, hf_greedy):
    engine = llm.engine
    first = engine.add_request("f1", PROMPTS[0], GREEDY)
    engine.inject_fault("step")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("f1", "error")]
    assert first.is_finished and not engine.has_unfinished()
    # the engine goes on: the next requests are served as usual
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == hf_greedy[:2]


def test_params_object_is_not_changed_by_the_engine(llm):
    params = SamplingParams(max_tokens=None, temperature=0)
    short = llm.engine.make_sequence("s", [5] * 10, params)
    long = llm.engine.make_sequence("l", [5] * 100, params)
    assert params.max_tokens is None
    assert (short.params.max_tokens, long.params.max_tokens) == (502, 412)


def test_async_engine_validates_before_streaming_and_dies_cleanly(model_dir):
    import asyncio

    from graphserve import AsyncEngine, EngineConfig
    from graphserve.engine.errors import EngineDeadError, RequestFailedError

    async def scenario():
        engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64))
        await engine.start()
        with pytest.raises(PromptTooLongError):
            engine.add_request([5] * 600, SamplingParams(max_tokens=4), "too-long")
        stream = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0), "ok")
        outs = [o async for o in stream]
        assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 4
        engine.inject_fault("step")
        with pytest.raises(RequestFailedError):
            [o async for o in engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4), "failed")]
        assert engine.ready
        engine.inject_fault("fatal")
        with pytest.raises(EngineDeadError):
            [o async for o in engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4), "dead")]
        assert engine.dead and not engine.ready
        await engine.shutdown()

    asyncio.run(scenario())


def test_closing_an_unread_stream_aborts_the_request(model_dir):
    import asyncio

    from graphserve import AsyncEngine, EngineConfig

    async def scenario():
        engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=64))
        await engine.start()
        total = engine.stats().kv_blocks_total
        stream = engine.add_request(PROMPTS[4], SamplingParams(max_tokens=400, ignore_eos=True), "unread")
        await asyncio.sleep(0.2)  # let it start running
        await stream.aclose()
        for _ in range(100):
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                break
            await asyncio.sleep(0.05)
        assert (stats.num_running, stats.num_waiting, stats.kv_blocks_free) == (0, 0, total)
        assert "unread" not in engine._queues
        await engine.shutdown()

    asyncio.run(scenario())


def test_engine_seed_makes_unseeded_sampling_reproducible(model_dir):
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    runs = [[o.token_ids for o in make_llm(model_dir, seed=seed).generate(PROMPTS[:3], params)] for seed in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len({tuple(t) for t in runs[0]}) == 3  # each request draws its own seed


def _run_merged(engine, steps: int | None = None, seen: dict | None = None) -> dict:
    """Step (until nothing is left, or `steps` times); each request's updates merged into `seen`."""
    seen = {} if seen is None else seen
    while engine.has_unfinished() and (steps is None or steps > 0):
        for out in engine.step():
            if out.request_id in seen:
                seen[out.request_id].merge(out)
            else:
                seen[out.request_id] = out
        steps = None if steps is None else steps - 1
    return seen


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_request_that_fails_inside_a_step_fails_alone(llm, hf_greedy, when):
    """Whatever slipped past validation and makes the model run raise: the batch is retried
    one request at a time, so only that request fails and its batch mates' tokens are
    exactly their solo ones."""
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"{when}{i}", PROMPTS[i], GREEDY)
    seen = _run_merged(engine, steps=1) if when == "decode" else {}  # decode: the prefill of all four first
    engine.inject_fault("request", f"{when}2")
    _run_merged(engine, seen=seen)
    assert seen[f"{when}2"].finish_reason == "error"
    assert [seen[f"{when}{i}"].token_ids for i in (0, 1, 3)] == [hf_greedy[i] for i in (0, 1, 3)]


def test_unseeded_sampling_differs_across_engines(model_dir):
    """Without --seed the seeds of unseeded requests come from the OS: a restart or another
    replica does not repeat the same "random" text."""
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    runs = [[o.token_ids for o in make_llm(model_dir).generate(PROMPTS[:3], params)] for _ in range(2)]
    assert runs[0] != runs[1]


def test_updates_carry_only_what_is_new(llm):
    """Each update holds the tokens and text added since the previous one (a slow reader's
    queue costs what it holds, not the output's length squared); together they are the output."""
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request("delta", PROMPTS[1], params)
    updates = []
    while engine.has_unfinished():
        updates += engine.step()
    whole = llm.generate([PROMPTS[1]], params)[0]
    assert len(updates) > 3 and all(len(u.token_ids) <= llm.engine.config.decode_chunk for u in updates)
    assert [t for u in updates for t in u.token_ids] == whole.token_ids
    assert "".join(u.text for u in updates) == whole.text
    assert [lp.token_id for u in updates for lp in u.logprobs] == whole.token_ids


def test_a_pool_holding_what_the_running_requests_write_serves_them_without_preemption(model_dir):
    """KV is reserved for the positions a decode round writes, no more: two requests whose
    tokens fill the 4 usable blocks exactly at the step where the first one ends (10 + 8 - 1
    slots, 2 blocks; 25 + 7 slots, 2 blocks, a third only after that) run side by side to the
    end, a token each per step, with no preemption, and get the tokens they get alone."""
    small = make_llm(model_dir, num_kv_blocks=1 + 4, decode_chunk=1)
    engine = small.engine
    first, second = PROMPTS[4][:10], PROMPTS[4][10:35]
    params = {"first": SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              "second": SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)}
    engine.add_request("first", first, params["first"])
    engine.add_request("second", second, params["second"])
    seen: dict = {}
    while engine.has_unfinished():
        step = {out.request_id: out for out in engine.step()}
        if "first" in seen and not seen["first"].finished:
            assert {rid: len(out.token_ids) for rid, out in step.items()} == {"first": 1, "second": 1}
        merge_updates(seen, step.values())
    assert engine.stats().num_preemptions == 0
    roomy = make_llm(model_dir)
    for rid, prompt in (("first", first), ("second", second)):
        assert seen[rid].token_ids == roomy.generate([prompt], params[rid])[0].token_ids
        assert seen[rid].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == 4


def test_a_prefill_step_on_cpu_also_gives_each_running_request_its_next_token(llm, hf_greedy):
    """Serving on a CPU, a newcomer's prefill step also advances every running request by one
    token, the one that ends it included: no running request waits for another's prompt."""
    engine = llm.engine
    params = {"last": SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
              "more": SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), "new": GREEDY}
    engine.add_request("last", PROMPTS[0], params["last"])
    engine.add_request("more", PROMPTS[1], params["more"])
    try:
        seen = {out.request_id: out for out in engine.step()}  # both prefills: a first token each
        engine.add_request("new", PROMPTS[2], params["new"])
        step = engine.step()
        assert {o.request_id: (len(o.token_ids), o.finish_reason) for o in step} == \
            {"last": (1, "length"), "more": (1, None), "new": (1, None)}
        for out in step:
            if out.request_id in seen:
                seen[out.request_id].merge(out)
            else:
                seen[out.request_id] = out
        _run_merged(engine, seen=seen)
    finally:  # a failure leaves the shared engine idle for the next tests
        for rid in params:
            engine.abort(rid)
    assert [seen[rid].token_ids for rid in ("last", "more", "new")] == [hf_greedy[0][:2], hf_greedy[1][:10],
                                                                         hf_greedy[2]]


def test_under_kv_pressure_the_newest_request_gives_way(model_dir):
    """Three requests that the pool cannot hold to their end: the one that arrived last is
    preempted (and recomputed later); the two before it stream a token every step to their
    end. Every request gets the tokens it gets alone."""
    small = make_llm(model_dir, num_kv_blocks=1 + 8, decode_chunk=1)  # 3 blocks each at the end: 9
    engine = small.engine
    prompts = {rid: PROMPTS[4][i:i + 16] for i, rid in enumerate(("old", "middle", "new"))}
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)  # 16 + 20 - 1 slots: 3 blocks
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    seen: dict = {}
    steps = 0
    while engine.has_unfinished():
        step = {out.request_id: out for out in engine.step()}
        steps += 1
        for rid in ("old", "middle"):
            if not (rid in seen and seen[rid].finished):
                assert rid in step and len(step[rid].token_ids) == 1, (steps, rid)
        merge_updates(seen, step.values())
    assert engine.stats().num_preemptions == 1
    assert [seen[rid].finished for rid in prompts] == [True] * 3
    roomy = make_llm(model_dir)
    for rid, prompt in prompts.items():
        assert seen[rid].token_ids == roomy.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("decode_chunk", [1, 4])
def test_each_update_carries_a_full_round_while_no_prefill_could_take_a_waiting_request(model_dir, hf_greedy,
                                                                                         decode_chunk):
    """A round is cut short only for requests a prefill could take now. With max_num_seqs 1, the
    second request waits for the first to end, and the first streams its prefill's token and then
    decode_chunk tokens per update (the last update what is left); then the second does the same."""
    llm = make_llm(model_dir, decode_chunk=decode_chunk, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    engine.add_request("first", PROMPTS[4], params)
    engine.add_request("queued", PROMPTS[1], params)
    sizes: dict = {"first": [], "queued": []}
    tokens: dict = {"first": [], "queued": []}
    while engine.has_unfinished():
        for out in engine.step():
            sizes[out.request_id].append(len(out.token_ids))
            tokens[out.request_id] += out.token_ids
    rounds = [1] + [decode_chunk] * (13 // decode_chunk) + ([13 % decode_chunk] if 13 % decode_chunk else [])
    assert sizes == {"first": rounds, "queued": rounds}
    assert [tokens["first"], tokens["queued"]] == [hf_greedy[4][:14], hf_greedy[1][:14]]


def test_the_first_update_times_the_wait_and_the_prefill_apart(model_dir):
    """The update with a request's first token carries when its prefill was first scheduled and
    when that token reached the engine's host (the server's queue and prefill time metrics): the
    request that waits for the batch (max_num_seqs 1) is scheduled only after the first one ends,
    and each prefill takes time after its scheduling."""
    import time

    llm = make_llm(model_dir, max_num_seqs=1)
    engine = llm.engine
    added = time.monotonic()
    for rid, prompt in (("first", PROMPTS[4]), ("second", PROMPTS[1])):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    times = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.core_times is not None:
                times[out.request_id] = out.core_times
    for rid in ("first", "second"):
        scheduled, first_token = times[rid]
        assert added <= scheduled < first_token
    assert times["second"][0] > times["first"][1]  # it waited for the first request's rounds


def test_a_pool_that_holds_one_request_at_a_time_serves_two_in_turn(model_dir):
    """Two requests whose KV outgrows a pool of 2 blocks on their first decode step: the older one
    runs to its end, the newer one is preempted and then recomputed, and each gets the tokens it
    gets alone, ending on max_tokens."""
    small = make_llm(model_dir, num_kv_blocks=1 + 2, decode_chunk=1)
    engine = small.engine
    prompts = {"older": PROMPTS[4][:16], "newer": PROMPTS[4][16:32]}  # a full block each
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)  # 16 + 10 - 1 slots: 2 blocks
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    seen: dict = {}
    finished = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in seen:
                seen[out.request_id].merge(out)
            else:
                seen[out.request_id] = out
            if out.finished:
                finished.append(out.request_id)
    assert finished == ["older", "newer"]
    assert engine.stats().num_preemptions >= 1
    roomy = make_llm(model_dir)
    for rid, prompt in prompts.items():
        assert (seen[rid].token_ids, seen[rid].finish_reason) == \
            (roomy.generate([prompt], params)[0].token_ids, "length")
    assert engine.block_manager.num_free_blocks == 2


def test_a_request_arriving_while_the_batch_is_full_does_not_cut_the_round(model_dir, hf_greedy):
    """Serving on a CPU with max_num_seqs 1: a request that arrives during a decode round cannot
    be prefilled before the running one ends, so the round is not cut for it; the running request
    still gets its decode_chunk tokens in one update, and the late one its tokens after it."""
    llm = make_llm(model_dir, decode_chunk=8, max_num_seqs=1)
    engine, core = llm.engine, llm.engine.core
    engine.add_request("running", PROMPTS[4], GREEDY)
    updates = engine.step()  # its prefill
    arrived = arrive_late(engine, core)
    try:
        whole = engine.step()
        assert [(u.request_id, len(u.token_ids)) for u in whole] == [("running", 8)]
        updates += whole
        while engine.has_unfinished():
            updates += engine.step()
    finally:
        core.on_wait = None
    for rid, i in (("running", 4), ("late", 1)):
        assert [t for u in updates if u.request_id == rid for t in u.token_ids] == hf_greedy[i]


def test_a_request_waits_until_a_step_has_prefill_budget_left_for_it(model_dir):
    """Chunked prefill (16 tokens a step): a second 40-token prompt waits (num_waiting, and the
    queue time of its first update) while the first prompt's chunks take the whole budget, and
    starts in the step where the first one's last chunk leaves room."""
    import time

    llm = make_llm(model_dir, max_num_batched_tokens=16)
    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("first", PROMPTS[4][:40], params)
    engine.add_request("second", PROMPTS[4][10:50], params)
    counts, ends, times = [], [], {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.core_times is not None:
                times[out.request_id] = out.core_times
        ends.append(time.monotonic())
        stats = engine.stats()
        counts.append((stats.num_running, stats.num_waiting))
    assert counts[:2] == [(1, 1), (1, 1)]  # chunks 16 and 16 of the first
    assert counts[2] == (2, 0)  # its last 8, and the second's first 8
    assert ends[1] < times["second"][0] < times["second"][1]
