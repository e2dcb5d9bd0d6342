"""KV cache groups (issue 61) for models whose layers have different windows: a tiny gpt-oss (window 8 and full
layers alternating) and a tiny Gemma 3 (5 layers of window 8 to 1 global), float32 on the CPU, prompts many
windows long. Each has two groups: the full layers' pool keeps a sequence's every block, the windowed layers'
pool only what the window still reads. Greedy tokens equal transformers', batched and alone, with prefix
caching on and off, under preemption, and through the static-buffer (CUDA-graph) paths run eagerly; a
prefix hit is the longest every group accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_gpt_oss, make_tiny_model, transformers_greedy

from graphserve import LLM, SamplingParams
from graphserve.engine.request import Sequence
from graphserve.engine.runner.cuda_graphs import GraphDecoder
from graphserve.engine.runner.prefill_graphs import PrefillGraphs
from graphserve.engine.sched.kv_cache import DUMMY_BLOCK, BlockManager
from graphserve.engine.sched.kv_groups import KVGroups, KVLayout

WINDOW, BS, CHUNK = 8, 4, 2
# prompts many windows long; the third shares the first's first 40 tokens
LONG = [[3 + (7 * i + 13 * j) % 400 for j in range(n)] for i, n in enumerate((90, 61))]
LONG.append(LONG[0][:40] + [5, 6, 7, 8, 9] * 4)
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# the windowed group's blocks a decoding sequence holds: positions c - W + 1 .. c + 1 of a round from c
PER_SEQ = -(-(WINDOW - 1 + CHUNK) // BS) + 1


def _gpt_oss(path: Path) -> tuple[Path, dict]:
    return make_tiny_gpt_oss(path, seed=4, sliding_window=WINDOW), dict(experts_implementation="eager")


def _gemma3(path: Path) -> tuple[Path, dict]:
    return make_tiny_model(path, "gemma3", seed=4, sliding_window=WINDOW), {}


MODELS = {"gpt_oss": _gpt_oss, "gemma3": _gemma3}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """The model's folder and transformers' greedy tokens for LONG."""
    path, load = MODELS[request.param](tmp_path_factory.mktemp(request.param) / "model")
    return path, transformers_greedy(path, LONG, PARAMS.max_tokens, **load)


def _llm(path: Path, **config) -> LLM:
    config = {"num_kv_blocks": 120, "max_num_seqs": 3, **config}
    return LLM(str(path), device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=32, decode_chunk=CHUNK,
               **config)


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt's tokens, and per group the most blocks in use after a step that follows the last prefill."""
    engine, groups = llm.engine, llm.engine.block_manager
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, PARAMS)
    got, peak, prefilled = [[] for _ in prompts], [0] * groups.num_groups, False
    for _ in range(1000):
        for out in engine.step():
            got[int(out.request_id)] += out.token_ids
        if prefilled:
            peak = [max(p, pool.num_used_blocks) for p, pool in zip(peak, groups.pools)]
        prefilled = all(got)
        if not engine.has_unfinished():
            return got, peak
    raise AssertionError("not finished after 1000 steps")


def _all_free(groups: KVGroups) -> bool:
    return all(pool.num_free_blocks == pool.num_usable_blocks and pool.reserved == 0 for pool in groups.pools)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_the_windowed_group_holds_its_window_and_the_full_group_the_context(model, prefix_caching):
    """Batched, twice (the second pass hits the cache where it is on), then alone: transformers' tokens; once
    prefilled the windowed pool holds at most PER_SEQ blocks a sequence while the full pool holds every
    prompt whole, and its pool is sized to that bound (for 16 sequences: room for the prompts' cached blocks
    too), not to the full pool's; every block free after."""
    path, want = model
    llm = _llm(path, prefix_caching=prefix_caching, num_kv_blocks=400, max_num_seqs=16)
    groups = llm.engine.block_manager
    full, windowed = groups.pools
    assert (full.window, windowed.window) == (None, WINDOW)
    assert windowed.num_blocks < full.num_blocks // 2
    whole = sum(-(-len(p) // BS) for p in LONG)
    for _ in range(2):
        got, (full_peak, windowed_peak) = _run(llm, LONG)
        assert got == want
        assert 0 < windowed_peak <= len(LONG) * PER_SEQ < whole <= full_peak
        assert _all_free(groups)
    again = llm.generate([LONG[1]], PARAMS)[0]
    assert again.token_ids == want[1]
    # the full group's blocks before the last token, and the windowed group's the next query reads, are cached
    assert again.num_cached_tokens == ((len(LONG[1]) - 1) // BS * BS if prefix_caching else 0)
    assert len({tuple(o) for o in want}) == len(LONG)


def test_a_long_generation_keeps_the_windowed_group_bounded(model):
    """One sequence generating 120 tokens: its windowed blocks stay at most PER_SEQ while its full blocks grow
    with every block of the context."""
    path, _ = model
    llm = _llm(path)
    engine, (full, windowed) = llm.engine, llm.engine.block_manager.pools
    prompt, params = LONG[1][:20], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    engine.add_request("long", prompt, params)
    engine.step()  # the prefill: 5 blocks in both groups, 4 of them then out of the window
    windowed_most, full_counts, usages = 0, [], []
    while engine.has_unfinished():
        engine.step()
        windowed_most = max(windowed_most, windowed.num_used_blocks)
        full_counts.append(full.num_used_blocks)
        stats = engine.stats()
        shares = [pool.num_used_blocks / pool.num_usable_blocks for pool in (full, windowed)]
        usages.append((stats.kv_cache_usage, max(shares), stats.kv_blocks_free))
    assert windowed_most <= PER_SEQ
    # the load gauge is the fullest pool's share (admission stops when any pool runs out), not the pools' sum
    assert all(usage == fullest for usage, fullest, _ in usages)
    assert max(usage for usage, _, _ in usages) > max(1 - free / stats.kv_blocks_total for _, _, free in usages)
    # the blocks of context the cache holds, as the endpoint picker reads them: the full group's
    assert stats.kv_context_blocks == full.num_usable_blocks < stats.kv_blocks_total
    assert max(full_counts) >= -(-(len(prompt) + 119) // BS) > 4 * PER_SEQ
    assert _all_free(llm.engine.block_manager)


def test_preemption_frees_every_group_and_recomputes(model):
    """A full pool of 47 usable blocks for contexts of 114 + 85 + 84 tokens: decodes preempt the newest
    sequence, which gives back its blocks in both groups and is recomputed later; transformers' tokens."""
    path, want = model
    llm = _llm(path, num_kv_blocks=48)
    assert [o.token_ids for o in llm.generate(LONG, PARAMS)] == want
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert _all_free(llm.engine.block_manager)


def test_speculative_verify_steps_write_every_group(model):
    """n-gram speculation (the repeating third prompt proposes drafts): a verify step reserves its drafts'
    slots in both groups and gives back the rejected ones in both; transformers' tokens."""
    path, want = model
    llm = _llm(path, speculative_method="ngram", num_speculative_tokens=3)
    assert [o.token_ids for o in llm.generate(LONG, PARAMS)] == want
    assert llm.engine.stats().spec_verify_rows > 0
    assert _all_free(llm.engine.block_manager)


def test_the_static_buffer_paths_take_a_table_per_group(model):
    """The decode graphs' and the prefill graphs' static buffers, run eagerly on the CPU (as on CUDA they are
    captured): a slot buffer and a block table per group; transformers' tokens, every decode step through them."""
    path, want = model
    llm = _llm(path)
    core = llm.engine.core
    width = -(-core.max_model_len // BS)
    runner = core.worker.runner
    runner.prefill_graphs = PrefillGraphs(core.worker.model, core.worker.kv_caches, BS, 32, 4, width, core.device,
                                          layer_groups=runner.layer_groups)
    runner.prefill_graphs.capture(progress=False)
    core.worker.graphs = GraphDecoder(runner, max_batch=4, max_steps=CHUNK, table_width=width, use_cuda_graphs=False)
    core.worker.graphs.capture(progress=False)
    assert len(core.worker.graphs.buffers.group_block_tables) == 1 and "slots1" in runner.prefill_graphs.static
    assert [o.token_ids for o in llm.generate(LONG, PARAMS)] == want
    stats = llm.engine.stats()
    assert sum(stats.graph_replays.values()) > 0 and "cpu" not in stats.eager_rounds
    assert stats.prefill_graph_steps > 0
    assert _all_free(llm.engine.block_manager)


def test_a_prefix_hit_is_the_longest_every_group_accepts():
    """A full pool hits on the cached run from the start, a windowed pool (window 10) on the blocks the next
    query reads; the groups' hit is the longest both accept: a prompt whose windowed blocks near its end were
    evicted gets none, though the full group holds its whole prefix; one whose window is cached gets it all."""
    window, greedy = 10, SamplingParams(max_tokens=4, temperature=0)
    layout = KVLayout.of((None, window, None, window))
    assert layout == KVLayout((None, window), (0, 1, 0, 1))
    groups = KVGroups([BlockManager(64, BS, prefix_caching=True, group=0),
                       BlockManager(24, BS, prefix_caching=True, window=window, group=1)], layout)
    full, windowed = groups.pools
    first = Sequence("a", LONG[0][:61], greedy)  # 15 full blocks before its last token
    groups.allocate(first, 61)
    allocated = list(first.block_tables[1])
    first.num_prefill_tokens, first.num_computed_tokens = 1, 61  # decoding
    groups.drop_out_of_window(first)  # the windowed group registers its blocks, then gives back 0..12
    assert first.block_tables[1][:13] == [DUMMY_BLOCK] * 13 and first.block_table == first.block_tables[0]
    assert DUMMY_BLOCK not in first.block_table and windowed.num_used_blocks == 3
    tables = [list(t) for t in first.block_tables]
    groups.free(first)
    # 17 blocks of the windowed pool taken: its 8 truly free ones, then the 9 least recently freed (blocks 0..8)
    hog = Sequence("hog", [1] * 68, greedy)
    hog.ensure_kv_groups(2)
    windowed.allocate(hog, 68)
    # the full group holds its first 10 blocks, but a query at position 40 reads blocks 7..10: 7 and 8 evicted
    shares_40 = Sequence("b", LONG[0][:40] + [9] * 9, greedy)
    assert full.longest_hit(shares_40, full.prefix_keys(shares_40), 12) == 10
    assert groups.cached_prefix(shares_40) == [[], []]
    same = Sequence("c", LONG[0][:61] + [7], greedy)  # a hit of 15 blocks: its query at 60 reads blocks 12..15
    hit = groups.cached_prefix(same)
    assert hit == [tables[0][:15], [DUMMY_BLOCK] * 12 + allocated[12:15]]


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_on_cuda_matches_transformers(model, enforce_eager):
    """One GPU, float32: each layer's Triton kernels read its group's tables and cache, through the decode and
    prefill graphs (a static table and slot buffer per group) or eagerly; the windowed group stays bounded."""
    path, want = model
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=BS, num_kv_blocks=120, max_num_seqs=3,
              max_num_batched_tokens=32, decode_chunk=CHUNK, enforce_eager=enforce_eager)
    assert llm.engine.block_manager.num_groups == 2
    got, (_, windowed_peak) = _run(llm, LONG)
    assert got == want
    assert windowed_peak <= len(LONG) * (-(-(WINDOW - 1 + 2 * CHUNK) // BS) + 1)  # a round launched ahead too
    assert _all_free(llm.engine.block_manager)
    if not enforce_eager:
        assert sum(llm.engine.stats().graph_replays.values()) > 0
    torch.cuda.synchronize()
