"""The warm-up burst an engine runs before it says ready (engine/core/warm_up.py), on a GPU and on the
CPU: it goes through the real scheduler, runner and sampler, and leaves nothing a client could see:
no request, no cached prefix, no counted token, and the same outputs as an engine that never ran it.
What a first burst would otherwise wait for is done before ready: on a CPU, the grammar vocabulary
(xgrammar's import and tables, seconds on two cores, which a background thread read after ready
while the first clients' steps waited for the GIL)."""

import pytest
from tiny_models import make_tiny_model

from graphserve import EngineConfig, SamplingParams
from graphserve.engine.core.engine_core import EngineCore
from graphserve.engine.core.warm_up import burst, warm_up

PROMPTS = [[5 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate((3, 17, 40, 1))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def run(core: EngineCore, params: SamplingParams) -> list[list[int]]:
    seqs = [core.make_sequence(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        core.add_sequence(seq)
    while core.has_unfinished():
        core.step()
    return [list(seq.output_token_ids) for seq in seqs]


def test_the_gpu_burst_covers_every_size_class_sampling_variant_and_a_cache_hit():
    wave, (repeat, _) = burst(max_model_len=4096, max_num_seqs=256, budget=1024, decode_chunk=8, vocab_size=1000,
                              on_gpu=True, grammar=True)
    lengths = {len(p) for p, _ in wave}
    assert {1, 16, 17, 1000} <= lengths and max(lengths) > 1024  # one block, a partial one, chunked
    assert max(lengths) <= 4096 - 17 - 1
    assert len(wave) >= 64  # the decode batch grows to a burst's size
    params = [p for _, p in wave]
    assert any(p.temperature == 0 for p in params) and any(p.top_p < 1 and p.top_k > 0 for p in params)
    assert any(p.logprobs for p in params) and any(p.presence_penalty for p in params)
    assert sum(p.grammar is not None for p in params) == 1
    assert repeat in [p for p, _ in wave] and len(repeat) >= 16  # at least one full block to hit
    assert all(max(p) < 1000 for p, _ in wave)


@pytest.mark.parametrize("max_model_len, decode_chunk", [(16, 8), (3, 2), (40, 8), (256, 2)])
def test_every_burst_request_fits_the_context_however_small(max_model_len, decode_chunk):
    """A pool of one block gives a context of 16 tokens: a burst request that did not fit would
    stop the engine from starting."""
    for on_gpu in (True, False):
        wave, repeat = burst(max_model_len, max_num_seqs=32, budget=1024, decode_chunk=decode_chunk,
                             vocab_size=1000, on_gpu=on_gpu, grammar=True)
        assert all(0 < len(p) and len(p) + params.max_tokens <= max_model_len for p, params in [*wave, repeat])


def test_a_cpu_engine_has_read_the_grammar_vocabulary_when_it_says_ready(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=96, max_model_len=256, warm_up=True)
    core = EngineCore(config)
    assert core.warmed_up and core.structured.compiler.vocabulary_loaded
    cold = EngineCore(EngineConfig(**{**config.__dict__, "warm_up": False}))
    assert not cold.warmed_up and not cold.structured.compiler.vocabulary_loaded


def test_the_warm_up_is_on_unless_the_environment_says_0_and_a_flag_overrides_that(monkeypatch):
    from graphserve.server.cli import build_parser, load_settings

    def engine(*flags: str) -> EngineConfig:
        return load_settings(build_parser().parse_args(["serve", *flags]))[1]

    monkeypatch.delenv("GRAPHSERVE_WARM_UP", raising=False)
    assert EngineConfig().warm_up and engine().warm_up and not engine("--no-warm-up").warm_up
    monkeypatch.setenv("GRAPHSERVE_WARM_UP", "0")
    assert not EngineConfig().warm_up and not engine().warm_up
    assert EngineConfig(warm_up=True).warm_up and engine("--warm-up").warm_up


def test_warm_up_leaves_no_trace_and_changes_no_output(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=96, decode_chunk=4, max_model_len=256)
    fresh = EngineCore(config)
    core = EngineCore(config)
    free_at_start = core.block_manager.num_free_blocks
    seconds = warm_up(core)
    assert seconds > 0
    stats = core.stats()
    assert stats.prompt_tokens == 0 and stats.generation_tokens == 0 and stats.prefill_steps == 0
    assert stats.prefix_cache_queries == 0 and stats.decode_rounds == 0
    assert not core.sequences and not core.has_unfinished()
    assert core.block_manager.num_free_blocks == free_at_start
    assert core.block_manager.num_cached_free_blocks == 0
    for params in (SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)):
        assert run(core, params) == run(fresh, params)


def test_a_front_end_warms_its_own_path_and_its_metrics_start_from_zero(model_dir, caplog):
    """server/warm_up.py, which a front end runs where the engine core warmed up (CUDA), here on the
    CPU through the app's own lifespan: every request of it is answered 200, /health says loading
    until it is done, and the metrics a client scrapes afterwards count none of it."""
    import asyncio
    import logging

    from graphserve import AsyncEngine
    from graphserve.server.app import create_app
    from graphserve.server.warm_up import REQUESTS, warm_up_front_end

    app = create_app(AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=96,
                                              max_model_len=256)))
    state = app.state.graphserve

    async def scenario() -> tuple[float, bytes]:
        async with app.router.lifespan_context(app):
            while state.warming_up:  # the CPU core does not warm up: the front end is ready at once
                await asyncio.sleep(0.01)
            state.warming_up = True
            assert state.status() == "ok" and state.health() == "loading"
            seconds = await warm_up_front_end(app, state)
            state.warming_up = False
            assert state.health() == "ok"
            return seconds, state.metrics.render()

    with caplog.at_level(logging.INFO, logger="graphserve.server"):
        seconds, metrics = asyncio.run(scenario())
    assert seconds > 0
    assert not [r for r in caplog.records if "warm-up" in r.getMessage()], "a warm-up request failed"
    assert len(REQUESTS) >= 5 and {path for path, _ in REQUESTS} == {"/v1/completions", "/v1/chat/completions"}
    assert any(body.get("stream") for _, body in REQUESTS) and any("response_format" in body for _, body in REQUESTS)
    text = metrics.decode()
    assert "graphserve_generation_tokens_total 0.0" in text
    assert 'graphserve_requests_total{finish_reason="length"}' not in text
