"""Sliding-window attention against transformers: tiny random windowed models (Mistral, window in every
layer; Qwen2 with use_sliding_window, full layers below max_window_layers and windowed above), float32 on
the CPU, prompts longer than the window: greedy tokens equal transformers', alone and batched, with
prefix caching on (a second pass hitting the cache) and off, on the C attention kernel, the decode stack
and torch's fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import assert_greedy_matches, make_tiny_model, transformers_greedy

from graphserve import LLM, SamplingParams
from graphserve.engine.errors import UnsupportedModelError
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.request import Sequence
from graphserve.engine.sched.kv_cache import DUMMY_BLOCK, BlockManager

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
# longer than the windows below (a shared start, so a second pass hits the prefix cache)
PROMPTS = [[3 + (11 * i + 5 * j) % 400 for j in range(n)] for i, n in enumerate((6, 37, 1, 22, 45))]
PROMPTS += [PROMPTS[4][:40] + [7, 8, 9]]
MODELS = {
    "mistral_w12": ("mistral", dict(sliding_window=12)),
    "mistral_w5": ("mistral", dict(sliding_window=5, num_key_value_heads=1)),
    "qwen2_mixed": ("qwen2", dict(use_sliding_window=True, sliding_window=9, max_window_layers=1,
                                  num_hidden_layers=3)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory) -> Path:
    variant, overrides = MODELS[request.param]
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "model", variant, seed=3, **overrides)


@pytest.fixture(scope="module")
def hf_greedy(model_dir) -> list[list[int]]:
    return transformers_greedy(model_dir, PROMPTS, MAX_NEW)


def _llm(model_dir: Path, **config) -> LLM:
    # a prefill budget under the longest prompt: prompts are chunked, and decodes ride along
    return LLM(str(model_dir), device="cpu", num_kv_blocks=96, max_num_batched_tokens=32, decode_chunk=2,
               **config)


def test_the_windows_are_read_per_layer(model_dir):
    args = ModelArgs.from_dir(model_dir)
    if args.architecture == "MistralForCausalLM":
        assert len(set(args.layer_windows)) == 1 and args.layer_windows[0] in (5, 12)
    else:
        assert args.layer_windows == (None, 9, 9)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_greedy_matches_transformers_alone_and_batched(model_dir, hf_greedy, prefix_caching):
    llm = _llm(model_dir, prefix_caching=prefix_caching)
    assert_greedy_matches(llm, PROMPTS, GREEDY, hf_greedy, alone=4)


def test_torch_fallback_and_no_decode_stack_match_transformers(model_dir, hf_greedy):
    """The same tokens with the decode stack off (the per-layer path) and with the attention kernel off
    too (gather + SDPA with the window masked)."""
    llm = _llm(model_dir)
    model = llm.engine.core.worker.model
    assert model.cpu_stack is not None  # the windows are the stack's too
    model.cpu_stack = None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy
    for layer in model.layers:
        layer.self_attn.backend.use_kernel = False
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy


def test_a_window_changes_the_tokens(model_dir, hf_greedy, tmp_path):
    """The test means something: the same weights without the window continue differently."""
    import json
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    config = json.loads((plain / "config.json").read_text())
    config.update(sliding_window=None, use_sliding_window=False)
    config.pop("layer_types", None)
    (plain / "config.json").write_text(json.dumps(config))
    assert transformers_greedy(plain, PROMPTS, MAX_NEW) != hf_greedy


@pytest.mark.parametrize("field,value", [("sliding_window", 0), ("sliding_window", "4k")])
def test_a_bad_window_is_refused_naming_the_field(field, value):
    cfg = dict(architectures=["MistralForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=8,
               num_hidden_layers=2, num_attention_heads=2)
    with pytest.raises(UnsupportedModelError, match=field):
        ModelArgs.from_hf_config({**cfg, field: value})


def test_unknown_layer_types_are_refused_naming_the_field():
    cfg = dict(architectures=["Qwen2ForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=8,
               num_hidden_layers=2, num_attention_heads=2, use_sliding_window=True, sliding_window=4,
               layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        ModelArgs.from_hf_config(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_on_cuda_matches_transformers(model_dir, hf_greedy, enforce_eager):
    """One GPU, float32: the Triton prefill and decode kernels with the window as a constant, through
    the decode and prefill graphs or eagerly."""
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=32,
              num_kv_blocks=96, enforce_eager=enforce_eager)
    assert_greedy_matches(llm, PROMPTS, GREEDY, hf_greedy)


# ---- the KV a window can no longer read goes back to the pool (issue 61) ----

WINDOW, BS = 10, 4
# prompts many windows long, sharing a start of 60 tokens (a second pass, and the third prompt, hit the cache)
LONG = [[3 + (7 * i + 13 * j) % 400 for j in range(n)] for i, n in enumerate((150, 97))]
LONG.append(LONG[0][:60] + [5, 6, 7, 8, 9] * 5)
LONG_PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("windowed") / "model", "mistral", seed=5, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def windowed_greedy(windowed_dir) -> list[list[int]]:
    return transformers_greedy(windowed_dir, LONG, LONG_PARAMS.max_tokens)


def _run_recording_blocks(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens, and the most blocks in use after any step that follows the last prefill."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, LONG_PARAMS)
    got, peak, prefilled = [[] for _ in prompts], 0, False
    for _ in range(500):
        for out in engine.step():
            got[int(out.request_id)] += out.token_ids
        if prefilled:  # a step after the last prefill's (whose schedule dropped what the prompts no longer read)
            peak = max(peak, engine.block_manager.num_used_blocks)
        prefilled = all(got)
        if not engine.has_unfinished():
            return got, peak
    raise AssertionError("not finished after 500 steps")


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_a_long_context_holds_only_its_windows_blocks(windowed_dir, windowed_greedy, prefix_caching):
    """Prompts of 150 and 97 tokens, a window of 10, blocks of 4: once prefilled, each sequence holds
    only the blocks its window and its round (decode_chunk 2) read, not its context's 40; the tokens
    are transformers'; every block is free again afterwards (twice: the second pass hits the cache)."""
    llm = LLM(str(windowed_dir), device="cpu", block_size=BS, num_kv_blocks=80, max_num_batched_tokens=32,
              decode_chunk=2, prefix_caching=prefix_caching)
    blocks = llm.engine.block_manager
    assert blocks.window == WINDOW
    start = blocks.num_free_blocks
    per_seq = -(-(WINDOW - 1 + 2) // BS) + 1  # positions c - W + 1 .. c + 1 of a round from c
    for _ in range(2):
        got, peak = _run_recording_blocks(llm, LONG)
        assert got == windowed_greedy
        assert 0 < peak <= len(LONG) * per_seq < -(-len(LONG[0]) // BS)
        assert blocks.num_free_blocks == start
    if prefix_caching:  # the blocks the prompt's last query reads are cached, those before them need not be
        assert llm.generate([LONG[0]], LONG_PARAMS)[0].num_cached_tokens == (len(LONG[0]) - 1) // BS * BS
    assert len({tuple(o) for o in windowed_greedy}) == len(LONG)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_a_pool_smaller_than_one_context_serves_every_prompt(windowed_dir, windowed_greedy, prefix_caching):
    """16 usable blocks (64 tokens) serve contexts of 174 tokens: a prefill takes its blocks chunk by chunk
    from what its admission reserved (the window before a chunk of 32 and the chunk: 12 blocks), so the
    prompts are admitted one by one and none stalls; transformers' tokens, every block free afterwards."""
    llm = LLM(str(windowed_dir), device="cpu", block_size=BS, num_kv_blocks=17, max_num_batched_tokens=32,
              decode_chunk=2, prefix_caching=prefix_caching)
    blocks = llm.engine.block_manager
    assert llm.engine.max_model_len > len(LONG[0]) + LONG_PARAMS.max_tokens > 16 * BS
    assert [o.token_ids for o in llm.generate(LONG, LONG_PARAMS)] == windowed_greedy
    assert blocks.num_free_blocks == 16 and blocks.reserved == 0


def test_a_windowed_pool_drops_frees_and_hits_only_the_windows_blocks():
    """The pool itself (window 10, blocks of 4): a sequence computed up to position c holds no block wholly
    before c - 9 (the dummy block takes its place); freed (as a preemption frees) every block is free
    again; a later prompt hits the cache on the blocks its next query reads, even with the blocks before
    them evicted, and shares nothing else."""
    blocks = BlockManager(num_blocks=40, block_size=BS, prefix_caching=True, window=WINDOW)
    prompt = LONG[1][:61]  # 15 full blocks before its last token
    seq = Sequence("a", prompt, GREEDY)
    blocks.allocate(seq, len(prompt))
    seq.num_prefill_tokens = 1  # decoding (a prefill's dropped blocks would stay reserved for its next chunk)
    for computed in (8, 30, 61):
        seq.num_computed_tokens = computed
        blocks.drop_out_of_window(seq)
        first = (computed - WINDOW + 1) // BS if computed >= WINDOW else 0
        assert seq.block_table[:first] == [DUMMY_BLOCK] * first and DUMMY_BLOCK not in seq.block_table[first:]
        assert blocks.num_used_blocks == len(seq.block_table) - first
    blocks.free(seq)
    assert blocks.num_free_blocks == blocks.num_usable_blocks
    assert blocks.num_cached_free_blocks == 15  # every full block registered, dropped or not
    blocks.allocate(Sequence("hog", [1] * 80, GREEDY), 80)  # 20 blocks: the 24 truly free ones first
    hog = Sequence("hog2", [2] * 60, GREEDY)
    blocks.allocate(hog, 60)  # 15 more: the free ones, then the 11 least recently freed cached blocks
    again = Sequence("b", prompt + [7], GREEDY)  # its next query (position 61) reads blocks 13..15
    hit = blocks.cached_prefix(again)
    assert hit[:12] == [DUMMY_BLOCK] * 12 and len(hit) == 15 and DUMMY_BLOCK not in hit[12:]
    used = blocks.num_used_blocks
    blocks.share(again, hit)
    assert blocks.num_used_blocks == used + 3
    blocks.free(again)
    blocks.free(hog)
    assert blocks.num_used_blocks == 20


def test_the_full_attention_pool_holds_every_block():
    """Without a window (Llama, Qwen: today's path) nothing is dropped."""
    blocks = BlockManager(num_blocks=40, block_size=BS)
    seq = Sequence("a", LONG[1], GREEDY)
    blocks.allocate(seq, len(LONG[1]))
    seq.num_computed_tokens = len(LONG[1])
    assert blocks.drop_out_of_window(seq) == 0 and DUMMY_BLOCK not in seq.block_table
