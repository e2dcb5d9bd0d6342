"""The prefill graphs' static-buffer path (engine/prefill_graphs.py): token buckets, padded
tokens, sequences and attention tiles. On CPU it runs the captured forward eagerly over the
same buffers; the CUDA replay is checked on the GPU (tests/test_gpu_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.prefill_graphs import PrefillGraphs, prefill_buckets
from engine.prefill_inputs import PrefillInputs, prefill_inputs
from engine.request import Sequence
from engine.scheduler import PrefillBatch
from tiny_models import make_tiny_model

BS = 16
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
SHARED = [7 + (11 * j) % 240 for j in range(53)]  # 3 full blocks and 5 tokens
PROMPTS = [SHARED + [20 + i, 30 + i, 40 + i][:1 + i % 3] for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def make_llm(model_dir, graphs: int, **kw) -> LLM:
    """An engine whose prefills of up to `graphs` tokens take the static-buffer path (0: none)."""
    kw.setdefault("num_kv_blocks", 96)
    llm = LLM(str(model_dir), device="cpu", block_size=BS, **kw)
    core = llm.engine.core
    if graphs:
        core.runner.prefill_graphs = PrefillGraphs(core.model, core.kv_caches, BS, graphs, 8,
                                                   -(-core.max_model_len // BS), core.device)
        core.runner.prefill_graphs.capture(progress=False)
    return llm


def tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_buckets():
    assert prefill_buckets(0) == []
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(100) == [16, 32, 64, 128]
    assert prefill_buckets(1024)[-1] == 1024


def test_prefill_inputs_pack_each_chunk_at_its_position():
    a, b = Sequence("a", list(range(100, 140)), GREEDY), Sequence("b", list(range(200, 205)), GREEDY)
    a.block_table, b.block_table = [3, 9, 4], [7]
    a.num_computed_tokens = 32  # a cached prefix of two blocks
    inputs = prefill_inputs(PrefillBatch([a, b], [8, 5]), BS)
    assert inputs.input_ids.tolist() == list(range(132, 140)) + list(range(200, 205))
    assert inputs.positions.tolist() == list(range(32, 40)) + list(range(5))
    assert inputs.slots.tolist() == [4 * BS + p for p in range(8)] + [7 * BS + p for p in range(5)]
    assert inputs.cu_seqlens.tolist() == [0, 8, 13] and inputs.context_lens.tolist() == [40, 5]
    assert inputs.last_rows.tolist() == [7, 12]
    assert inputs.block_tables.tolist() == [[3, 9, 4], [7, 0, 0]]


def test_a_batch_takes_the_smallest_bucket_that_holds_its_tokens_and_sequences(model_dir):
    graphs = make_llm(model_dir, graphs=64).engine.core.runner.prefill_graphs

    def lens(*q: int) -> PrefillInputs:
        n, b = sum(q), len(q)
        return PrefillInputs(np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64), np.array(q),
                             np.zeros(b, np.int32), np.zeros(b + 1, np.int32), np.zeros((b, 1), np.int32))

    assert graphs.bucket_for(lens(3)) == 16
    assert graphs.bucket_for(lens(16)) == 16
    assert graphs.bucket_for(lens(10, 10)) == 32
    assert graphs.bucket_for(lens(*[1] * 8)) == 16
    assert graphs.bucket_for(lens(*[1] * 9)) is None  # the graphs hold 8 sequences
    assert graphs.bucket_for(lens(65)) is None


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_static_prefill_path_gives_the_eager_tokens(model_dir, params, caching):
    """Prefix-cache hits (short tails after 3 cached blocks), whole prompts, several sequences
    per batch and prompts too long for a bucket: the same tokens as eager prefills."""
    eager = make_llm(model_dir, graphs=0, prefix_caching=caching)
    static = make_llm(model_dir, graphs=64, prefix_caching=caching)
    want = tokens(eager, PROMPTS[:1], params) + tokens(eager, PROMPTS[1:], params)
    assert tokens(static, PROMPTS[:1], params) + tokens(static, PROMPTS[1:], params) == want
    runner = static.engine.core.runner
    assert runner.num_graph_prefills > 0
    assert static.engine.stats().prefill_graph_steps == runner.num_graph_prefills
    # 54-56 tokens each: the first prompt alone fits the 64 bucket, five together do not;
    # with the cache, their tails (6-8 tokens each) do
    assert runner.num_graph_prefills == (2 if caching else 1)
    # the padded rows wrote only into the dummy block: the same requests again, the same tokens
    assert tokens(static, PROMPTS, params) == tokens(eager, PROMPTS, params)


def test_chunked_prefill_through_the_static_path(model_dir):
    eager = make_llm(model_dir, graphs=0, max_num_batched_tokens=24)
    static = make_llm(model_dir, graphs=32, max_num_batched_tokens=24)
    assert tokens(static, PROMPTS[:3]) == tokens(eager, PROMPTS[:3])
    stats = static.engine.stats()  # every step: a 24-token chunk, or a tail after a hit, and the decodes riding along
    assert stats.prefill_graph_steps == stats.prefill_steps >= 3


def test_prompt_logprobs_take_the_eager_path(model_dir):
    eager = make_llm(model_dir, graphs=0)
    static = make_llm(model_dir, graphs=64)
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    want = eager.generate([PROMPTS[0][:20]], params)[0]
    got = static.generate([PROMPTS[0][:20]], params)[0]
    assert got.token_ids == want.token_ids and got.prompt_logprobs == want.prompt_logprobs
    assert static.engine.core.runner.num_graph_prefills == 0
