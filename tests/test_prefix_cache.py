"""Prefix caching (engine/sched/kv_cache.py): a prompt's cached full blocks are shared, only the
rest is prefilled, and the tokens are exactly those of a run without the cache."""

from __future__ import annotations

import pytest

from graphserve import LLM, SamplingParams

from graphserve.engine.sched import prefix_hash
from graphserve.engine.sched.kv_cache import BlockManager
from graphserve.engine.request import Sequence
from tiny_models import make_tiny_model

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
SHARED = [7 + (11 * j) % 240 for j in range(53)]  # 3 full blocks and 5 tokens
PROMPTS = [SHARED + [20 + i, 30 + i, 40 + i] for i in range(5)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def make_llm(model_dir, caching: bool, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 96)
    return LLM(str(model_dir), device="cpu", prefix_caching=caching, block_size=BS, **kw)


@pytest.fixture(scope="module")
def plain(model_dir) -> LLM:
    return make_llm(model_dir, caching=False)


def tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def assert_idle(llm: LLM) -> None:
    """Every block is free or cached-free, and the counts add up (in each KV cache group's pool)."""
    assert not llm.engine.has_unfinished()
    for blocks in llm.engine.block_manager.pools:
        assert blocks.num_free_blocks == blocks.num_usable_blocks
        assert len(blocks.free_blocks) + blocks.num_cached_free_blocks == blocks.num_usable_blocks
        assert all(blocks.ref_counts[b] == 0 for b in range(1, blocks.num_blocks))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_shared_prefix_gives_the_same_tokens(model_dir, plain, params):
    cached = make_llm(model_dir, caching=True)
    want = tokens(plain, PROMPTS, params)
    assert tokens(cached, PROMPTS[:1], params) == want[:1]  # fills the cache
    stats = cached.engine.stats()
    assert tokens(cached, PROMPTS[1:], params) == want[1:]  # concurrent requests sharing it
    after = cached.engine.stats()
    assert after.prefix_cache_hits - stats.prefix_cache_hits == 4 * 3 * BS
    assert_idle(cached)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_requests_arriving_together_compute_a_shared_prefix_once(model_dir, plain, params):
    """A burst of requests sharing a prefix the cache does not hold yet: the first computes
    it, the others wait for its prefill (one step) and then hit it, instead of each
    computing it again. Tokens as without the cache."""
    cached = make_llm(model_dir, caching=True)
    want = tokens(plain, PROMPTS, params)
    before = cached.engine.stats()
    assert tokens(cached, PROMPTS, params) == want
    after = cached.engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 4 * 3 * BS
    assert after.prompt_tokens - before.prompt_tokens == sum(map(len, PROMPTS)) - 4 * 3 * BS
    assert_idle(cached)


def test_a_running_request_shares_its_prefilled_prefix(model_dir, plain):
    """Blocks are registered once prefilled, not only when their request ends: a request
    arriving while the first one still decodes hits them."""
    cached = make_llm(model_dir, caching=True)
    engine = cached.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("first", PROMPTS[0], params)
    outs: dict = {"first": engine.step()}  # its prefill
    engine.add_request("second", PROMPTS[1], params)
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert outs["second"][0].num_cached_tokens == 3 * BS
    got = {r: [t for o in outs[r] for t in o.token_ids] for r in outs}
    assert [got["first"], got["second"]] == tokens(plain, PROMPTS[:2], params)
    assert_idle(cached)


def test_a_prompt_made_of_full_blocks_recomputes_its_last_token(model_dir, plain):
    prompt = SHARED[:3 * BS]  # exactly three blocks
    cached = make_llm(model_dir, caching=True)
    first = cached.generate([prompt], GREEDY)[0]
    again = cached.generate([prompt], GREEDY)[0]
    assert first.token_ids == again.token_ids == tokens(plain, [prompt])[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 2 * BS)
    assert_idle(cached)


def test_multi_turn_resends_hit_the_history(model_dir, plain):
    """Each turn resends the whole conversation: its prompt and the answers (their KV was
    computed while generating) are found in the cache."""
    cached = make_llm(model_dir, caching=True)
    history, computed = list(SHARED), 0
    for turn in range(4):
        out = cached.generate([history], GREEDY)[0]
        assert out.token_ids == tokens(plain, [history])[0]
        # the full blocks of everything the last turn computed (all but its last token)
        assert out.num_cached_tokens == min(computed // BS, (len(history) - 1) // BS) * BS
        computed = len(history) + len(out.token_ids) - 1
        history = history + out.token_ids + [50 + turn, 60 + turn]
    assert_idle(cached)


@pytest.mark.parametrize("budget", [16, 24, 200])
def test_chunked_prefill_after_a_hit(model_dir, plain, budget):
    cached = make_llm(model_dir, caching=True, max_num_batched_tokens=budget)
    want = tokens(plain, PROMPTS[:3])
    assert tokens(cached, PROMPTS[:1]) == want[:1]
    assert tokens(cached, PROMPTS[1:3]) == want[1:3]
    assert_idle(cached)


def test_preempted_requests_are_readmitted_through_the_cache(model_dir, plain):
    """A pool too small for all of them: requests are preempted, and come back hitting the
    blocks they (and the others) computed."""
    long = [p + list(range(100, 100 + 20 * i)) for i, p in enumerate(PROMPTS)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    cached = make_llm(model_dir, caching=True, num_kv_blocks=22)
    got = tokens(cached, long, params)
    assert cached.engine.scheduler.num_preemptions > 0
    assert got == tokens(plain, long, params)
    assert cached.engine.stats().prefix_cache_hits > 0
    assert_idle(cached)


def test_a_hash_collision_never_hands_out_wrong_kv(model_dir, plain, monkeypatch):
    """Every block hashes alike: the stored token ids tell them apart (other prompts whose ids are
    above and below the cached one's)."""
    monkeypatch.setattr(prefix_hash, "block_key", lambda parent, toks: b"same")
    cached = make_llm(model_dir, caching=True)
    assert tokens(cached, PROMPTS[:1]) == tokens(plain, PROMPTS[:1])
    for other in ([200 + (3 * j) % 50 for j in range(53)], [3 + (5 * j) % 4 for j in range(53)]):
        assert tokens(cached, [other]) == tokens(plain, [other])
    assert cached.engine.stats().prefix_cache_hits == 0
    assert_idle(cached)


def test_each_block_is_hashed_once_however_often_its_prompt_is_looked_up(monkeypatch):
    """A prompt waiting behind a prefill that computes its prefix is looked up every step, and its
    prefill registers the same blocks: the hash chain is made once per block, not per lookup."""
    calls = []
    real = prefix_hash.block_key
    monkeypatch.setattr(prefix_hash, "block_key", lambda parent, toks: calls.append(1) or real(parent, toks))
    blocks = BlockManager(num_blocks=20, block_size=4, prefix_caching=True)
    seq = Sequence("w", list(range(30)), GREEDY)  # 7 full blocks before its last token
    keys = [blocks.prefix_keys(seq) for _ in range(5)]
    assert all(k == keys[0] for k in keys) and len(keys[0]) == 7 and len(calls) == 7
    blocks.allocate(seq, 30)
    seq.num_computed_tokens = 30
    blocks.register(seq)
    assert seq.block_hashes == keys[0] and len(calls) == 7  # the 7 keys reused
    seq.token_ids += [30, 31]  # generated tokens fill an 8th block
    seq.num_computed_tokens = 32
    blocks.register(seq)
    assert len(seq.block_hashes) == 8 and len(calls) == 8
    fresh = BlockManager(num_blocks=20, block_size=4, prefix_caching=True)
    assert fresh.prefix_keys(Sequence("x", list(range(30)), GREEDY)) == keys[0]  # the same chain from scratch


def test_a_front_ends_prompt_keys_are_the_cores_and_wrong_ones_only_miss():
    blocks = BlockManager(num_blocks=20, block_size=4, prefix_caching=True, cache_salt="m")
    prompt = list(range(30))
    from_front_end = prefix_hash.prompt_keys(prompt, 4, prefix_hash.chain_root("m"))
    assert from_front_end == blocks.prefix_keys(Sequence("core", prompt, GREEDY))
    owner = Sequence("o", prompt, GREEDY)
    blocks.allocate(owner, 30)
    owner.num_computed_tokens = 30
    blocks.register(owner)
    blocks.free(owner)
    seq = Sequence("a", prompt, GREEDY)
    blocks.adopt_prompt_keys(seq, from_front_end)
    assert len(blocks.cached_prefix(seq)) == 7
    short = Sequence("b", prompt, GREEDY)
    blocks.adopt_prompt_keys(short, from_front_end[:3])  # the wrong count: not taken
    assert short.block_keys == [] and len(blocks.cached_prefix(short)) == 7
    other = Sequence("c", list(range(100, 130)), GREEDY)
    blocks.adopt_prompt_keys(other, from_front_end)  # keys of another prompt: the tokens differ
    assert blocks.cached_prefix(other) == []


def test_a_prompt_hits_only_the_blocks_before_its_first_difference(model_dir, plain):
    """One token changed anywhere in a block (its first, its last) and that block and every one
    after it miss; the blocks before it hit. Tokens as without the cache."""
    cached = make_llm(model_dir, caching=True)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    base = PROMPTS[0]  # 3 full blocks before its last token
    cached.generate([base], params)
    for pos in (0, BS - 1, BS, 2 * BS - 1, 2 * BS, 3 * BS - 1, 3 * BS, len(base) - 1):
        prompt = list(base)
        prompt[pos] = 255 - prompt[pos]
        out = cached.generate([prompt], params)[0]
        assert out.num_cached_tokens == min(pos // BS, 3) * BS, pos
        assert out.token_ids == tokens(plain, [prompt], params)[0]
    assert_idle(cached)


def test_the_core_takes_a_long_prompts_keys_from_the_front_end_and_only_of_the_right_count(monkeypatch):
    """A prompt of hundreds of blocks (thousands of tokens): the core looks it up with the keys the
    front end made, hashing none of its prompt blocks again; a list of another length is not taken."""
    prompt = [3 + (7 * j) % 250 for j in range(300 * BS + 5)]
    keys = prefix_hash.prompt_keys(prompt, BS, prefix_hash.chain_root("m"))
    assert len(keys) == 300
    calls = []
    real = prefix_hash.block_key
    monkeypatch.setattr(prefix_hash, "block_key", lambda parent, toks: calls.append(1) or real(parent, toks))
    blocks = BlockManager(num_blocks=400, block_size=BS, prefix_caching=True, cache_salt="m")
    seq = Sequence("long", prompt, GREEDY)
    blocks.adopt_prompt_keys(seq, keys)
    assert blocks.prefix_keys(seq) == keys and calls == []
    for wrong in (keys[:-1], keys + keys[:1]):
        other = Sequence("other", prompt, GREEDY)
        blocks.adopt_prompt_keys(other, wrong)
        assert other.block_keys == []
    assert blocks.prefix_keys(other) == keys  # the core's own, all the same


def test_the_front_end_hashes_the_prompt_and_the_core_thread_does_not(model_dir, monkeypatch):
    """Through the server (its core in a thread here): a prompt's block keys are made beside
    its tokenization, and the core reuses them for lookup and registration."""
    import threading

    import httpx

    from graphserve import AsyncEngine, EngineConfig
    from graphserve.server.app import create_app
    from live_server import BackgroundServer

    threads = []
    real = prefix_hash.block_key
    monkeypatch.setattr(prefix_hash, "block_key",
                        lambda parent, toks: threads.append(threading.current_thread().name) or real(parent, toks))
    config = EngineConfig(model=str(model_dir), device="cpu", block_size=BS, num_kv_blocks=96)
    with BackgroundServer(create_app(AsyncEngine(config))) as server:
        server.wait_ready()
        threads.clear()  # the engine's warm-up burst, sent by the core itself before ready
        with httpx.Client(base_url=server.url, timeout=60.0) as http:
            usages = [http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
                      .json()["usage"] for prompt in PROMPTS[:2]]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    assert len(threads) == 2 * 3 and "graphserve-engine" not in threads


def test_eviction_is_lru_and_spares_blocks_in_use():
    blocks = BlockManager(num_blocks=9, block_size=4, prefix_caching=True)

    def finished(prompt: list[int]) -> Sequence:
        seq = Sequence(str(prompt[0]), prompt, GREEDY)
        blocks.allocate(seq, len(prompt))
        seq.num_computed_tokens = len(prompt)
        return seq

    a, b = finished(list(range(0, 8))), finished(list(range(100, 108)))  # 2 full blocks each
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_cached_free_blocks == 4 and len(blocks.free_blocks) == 4
    user = Sequence("u", list(range(100, 108)) + [1], GREEDY)  # b's blocks, in use again
    blocks.share(user, blocks.cached_prefix(user))
    assert len(user.block_table) == 2 and blocks.num_cached_free_blocks == 2
    hog = Sequence("h", list(range(500, 524)), GREEDY)
    blocks.allocate(hog, 24)  # 6 blocks: the 4 free ones, then a's two (the only evictable ones)
    assert blocks.num_free_blocks == 0
    assert blocks.cached_prefix(Sequence("a", list(range(0, 8)) + [1], GREEDY)) == []  # a was evicted
    assert blocks.cached_prefix(Sequence("b", list(range(100, 108)) + [1], GREEDY)) == user.block_table
    for seq in (user, hog):
        blocks.free(seq)
    assert blocks.num_free_blocks == blocks.num_usable_blocks


def test_a_cached_1500_token_prefix_cuts_time_to_first_token_over_http():
    """The embedded model behind the real server: a second request sharing a 1,500-token
    prefix gets its first token at least 3x sooner than the first one."""
    import time

    import httpx

    from graphserve import AsyncEngine, EngineConfig
    from graphserve.server.app import create_app
    from live_server import BackgroundServer

    config = EngineConfig(device="cpu", max_model_len=2048, kv_cache_bytes=256 * 1024**2,
                          max_num_batched_tokens=2048)
    shared = [100 + (37 * j) % 40000 for j in range(1500)]
    with BackgroundServer(create_app(AsyncEngine(config))) as server:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=120.0) as http:
            def time_to_first_token(suffix: list[int]) -> tuple[float, dict]:
                body = {"prompt": shared + suffix, "max_tokens": 1, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                started = time.perf_counter()
                first, usage = None, None
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {") and first is None and '"text":""' not in line:
                            first = time.perf_counter() - started
                        if '"usage":{' in line:
                            usage = httpx.Response(200, content=line[6:]).json()["usage"]
                return first, usage

            cold, cold_usage = time_to_first_token([5, 6, 7, 8, 9])
            warm, warm_usage = time_to_first_token([15, 16, 17, 18, 19])
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm_usage["prompt_tokens_details"]["cached_tokens"] == 1500 // BS * BS
    assert warm * 3 <= cold, (cold, warm)


def test_a_request_sharing_a_running_requests_prefix_needs_blocks_only_for_the_rest(model_dir, plain):
    """A pool that holds the shared prefix once, and the tail of each request: a request whose prefix
    a running one holds is admitted beside it (the shared blocks are not taken from the free ones
    again), both decode together without preemption, and every block is free afterwards."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)  # 56 + 8 - 1 slots: 4 blocks
    cached = make_llm(model_dir, caching=True, num_kv_blocks=1 + 4 + 1)  # 3 shared, 1 + 1 own
    engine = cached.engine
    engine.add_request("first", PROMPTS[0], params)
    outs: dict = {"first": engine.step()}  # its prefill: 4 of the 5 blocks taken
    engine.add_request("second", PROMPTS[1], params)
    first_done_at = second_first_at = None
    for step in range(100):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
            if out.request_id == "second" and out.token_ids and second_first_at is None:
                second_first_at = step
            if out.request_id == "first" and out.finished:
                first_done_at = step
    assert second_first_at is not None and first_done_at is not None
    assert second_first_at < first_done_at  # admitted while the first still ran
    assert outs["second"][0].num_cached_tokens == 3 * BS
    got = {r: [t for o in outs[r] for t in o.token_ids] for r in outs}
    assert [got["first"], got["second"]] == tokens(plain, PROMPTS[:2], params)
    assert engine.stats().num_preemptions == 0
    assert_idle(cached)


def test_eviction_takes_the_least_recently_used_prefix_first(model_dir, plain):
    """A pool that keeps three prompts' prefixes: a fourth prompt evicts the one used least
    recently (the first, since the second was resent), and the resent one still hits."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    first, second, third, fourth = ([3 + (5 * i + 7 * j) % 240 for j in range(2 * BS + 1)] for i in range(4))
    cached = make_llm(model_dir, caching=True, num_kv_blocks=1 + 7)  # 3 blocks each, 2 of them cached

    def cached_tokens(prompt: list[int]) -> int:
        out = cached.generate([prompt], params)[0]
        assert out.token_ids == tokens(plain, [prompt], params)[0]
        return out.num_cached_tokens

    assert [cached_tokens(p) for p in (first, second, third, second)] == [0, 0, 0, 2 * BS]
    assert cached_tokens(fourth) == 0  # takes the last truly free block and evicts two cached ones
    assert cached_tokens(second) == 2 * BS
    assert cached_tokens(third) == 2 * BS
    assert cached_tokens(first) == 0  # the least recently used: evicted
    assert_idle(cached)


def test_a_prefill_aborted_midway_leaves_its_prompt_to_the_next_request(model_dir, plain):
    """A request aborted during its chunked prefill, before it computed all its prompt's blocks: a
    later request with the same prompt hits the blocks it did compute, computes the rest itself
    (nobody else will), and gets the tokens of a run without the cache."""
    prompt = PROMPTS[0]
    cached = make_llm(model_dir, caching=True, max_num_batched_tokens=BS)
    engine = cached.engine
    engine.add_request("cut", prompt, GREEDY)
    engine.step()  # the first chunk: one block of the prompt's four computed
    engine.abort("cut")
    engine.add_request("again", prompt, GREEDY)
    outs = []
    for _ in range(100):
        if not engine.has_unfinished():
            break
        outs += [out for out in engine.step() if out.request_id == "again"]
    assert not engine.has_unfinished(), "the request with the same prompt never ran"
    assert [t for out in outs for t in out.token_ids] == tokens(plain, [prompt])[0]
    assert outs[0].num_cached_tokens == BS
    assert_idle(cached)


def test_a_request_waiting_for_a_shared_prefix_holds_back_no_one_behind_it(model_dir, plain):
    """Three requests arrive together: the second shares the first one's prefix and waits for its
    prefill to hit it; the third shares nothing and is prefilled beside the first at once, not held
    back behind the second. The second then hits the prefix. Tokens as without the cache."""
    cached = make_llm(model_dir, caching=True)
    engine = cached.engine
    other = [200 + (3 * j) % 50 for j in range(40)]
    prompts = {"first": PROMPTS[0], "second": PROMPTS[1], "other": other}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    outs: dict = {}
    first_step = engine.step()
    assert sorted(o.request_id for o in first_step) == ["first", "other"]
    for out in first_step:
        outs[out.request_id] = [out]
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert outs["second"][0].num_cached_tokens == 3 * BS
    got = {rid: [t for o in outs[rid] for t in o.token_ids] for rid in prompts}
    assert [got[rid] for rid in prompts] == tokens(plain, list(prompts.values()))
    assert_idle(cached)
