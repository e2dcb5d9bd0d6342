"""The graph decoder's static-buffer path (bucket padding, dummy rows, variants). On CPU
it runs the captured step eagerly over the same buffers; on CUDA (marked gpu) it replays
real CUDA graphs."""

import pytest
import torch

from graphserve import LLM, SamplingParams
from graphserve.engine.runner.cuda_graphs import GraphDecoder, batch_buckets, eager_reason
from tiny_models import make_tiny_model

PROMPTS = [[5 + (11 * i + j) % 250 for j in range(n)] for i, n in enumerate((3, 17, 30, 8, 50))]


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(12)[-1] >= 12
    assert batch_buckets(10_000)[-1] == 512


def test_eager_reasons():
    from graphserve.engine.request import Sequence

    plain = Sequence("a", [1, 2], SamplingParams(max_tokens=4))
    assert eager_reason([plain], 8) is None
    assert eager_reason([plain] * 9, 8) == "batch_exceeds_largest_bucket"
    assert eager_reason([Sequence("b", [1], SamplingParams(logprobs=2))], 8) == "top_logprobs"
    assert eager_reason([Sequence("c", [1], SamplingParams(frequency_penalty=1.0))], 8) == "logits_processors"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


def _with_static_decoder(llm: LLM) -> LLM:
    engine = llm.engine.core
    engine.worker.graphs = GraphDecoder(engine.worker.runner, max_batch=8, max_steps=engine.config.decode_chunk,
                                 table_width=-(-engine.max_model_len // engine.config.block_size),
                                 use_cuda_graphs=engine.device.type == "cuda")
    engine.worker.graphs.capture(progress=False)
    return llm


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=40, seed=5, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_static_buffer_path_matches_eager(model_dir, params):
    eager = LLM(str(model_dir), device="cpu", num_kv_blocks=64, decode_chunk=4)
    static = _with_static_decoder(LLM(str(model_dir), device="cpu", num_kv_blocks=64, decode_chunk=4))
    for batch in (PROMPTS[:1], PROMPTS[:3], PROMPTS):  # buckets 1, 4 and 8 with padding
        want = [o.token_ids for o in eager.generate(batch, params)]
        assert [o.token_ids for o in static.generate(batch, params)] == want
    stats = static.engine.stats()
    assert set(stats.graph_replays) == {1, 4, 8}
    assert "cpu" not in stats.eager_rounds
    assert stats.kv_blocks_free == stats.kv_blocks_total
    # padded rows only ever wrote into the dummy block: the same requests again give the same tokens
    assert [o.token_ids for o in static.generate(PROMPTS, params)] == [o.token_ids for o in eager.generate(PROMPTS, params)]


def test_rounds_that_need_eager_fall_back(model_dir):
    static = _with_static_decoder(LLM(str(model_dir), device="cpu", num_kv_blocks=64, decode_chunk=4))
    static.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0, logprobs=2))
    assert static.engine.stats().eager_rounds == {"top_logprobs": 2}


def test_no_garbage_collection_starts_inside_a_graph_capture():
    """engine/gc_stats.paused, around both graph captures: a collection in the middle of a capture
    may free another engine's graph pool (cudaFree), which invalidates the capture. Collections are
    off inside, back on after (also after an error), and left off where they were off."""
    import gc

    from graphserve.engine import gc_stats

    assert gc.isenabled()
    with gc_stats.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_stats.paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_stats.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
