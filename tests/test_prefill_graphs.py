"""The prefill graphs' static-buffer path (engine/runner/prefill_graphs.py): token buckets, padded
tokens, sequences and attention tiles. On CPU it runs the captured forward eagerly over the
same buffers; the CUDA replay is checked on the GPU (tests/test_gpu_engine.py)."""

from __future__ import annotations

import pytest

from graphserve import LLM, SamplingParams
from graphserve.engine.request import Sequence
from graphserve.engine.runner.prefill_graphs import PrefillGraphs, prefill_buckets
from graphserve.engine.runner.prefill_inputs import prefill_inputs
from graphserve.engine.sched.scheduler import PrefillBatch
from tensor_checks import report
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
        core.worker.runner.prefill_graphs = PrefillGraphs(core.worker.model, core.worker.kv_caches, BS, graphs, 8,
                                                   -(-core.max_model_len // BS), core.device)
        core.worker.runner.prefill_graphs.capture(progress=False)
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
    graphs = make_llm(model_dir, graphs=64).engine.core.worker.runner.prefill_graphs
    assert graphs.bucket_for(3, 1) == 16
    assert graphs.bucket_for(16, 1) == 16
    assert graphs.bucket_for(20, 2) == 32
    assert graphs.bucket_for(8, 8) == 16
    assert graphs.bucket_for(9, 9) is None  # the graphs hold 8 sequences
    assert graphs.bucket_for(65, 1) is None


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_static_prefill_path_gives_the_eager_tokens(model_dir, params, caching):
    """Prefix-cache hits (short tails after 3 cached blocks), whole prompts, several sequences
    per batch and prompts too long for a bucket: the same tokens as eager prefills."""
    eager = make_llm(model_dir, graphs=0, prefix_caching=caching)
    static = make_llm(model_dir, graphs=64, prefix_caching=caching)
    want = tokens(eager, PROMPTS[:1], params) + tokens(eager, PROMPTS[1:], params)
    assert tokens(static, PROMPTS[:1], params) + tokens(static, PROMPTS[1:], params) == want
    runner = static.engine.core.worker.runner
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
    assert static.engine.core.worker.runner.num_graph_prefills == 0


def two_running_requests(blocks) -> tuple[Sequence, Sequence]:
    """Two requests of 35 tokens holding their blocks: one to end (or be aborted), one that runs on."""
    pair = (Sequence("ending", list(range(5, 40)), GREEDY), Sequence("fresh", list(range(5, 40)), GREEDY))
    for seq in pair:
        blocks.allocate(seq, 35)
    return pair


def test_a_prefill_overtakes_running_rounds_only_into_blocks_they_cannot_write(model_dir):
    """EngineCore._may_overtake: a prefill may run ahead of the rounds still on the device
    unless a block it writes was freed after the launch of one of them (a request that ended
    inside that round, whose steps past its end that round still runs)."""
    core = make_llm(model_dir, graphs=64, prefill_ahead=True).engine.core
    blocks = core.block_manager
    ended, fresh = two_running_requests(blocks)
    reused = list(ended.block_table)
    batch = lambda seq: PrefillBatch([seq], [35])  # noqa: E731
    assert not core._may_overtake(batch(fresh))  # nothing running: nothing to overtake
    blocks.rounds_launched, core._rounds_completed = 4, 3  # round 4 runs
    assert core._may_overtake(batch(fresh))
    blocks.free(ended)  # while round 4 runs
    again = Sequence("again", list(range(5, 40)), GREEDY)
    again.block_table = reused
    assert not core._may_overtake(batch(again))
    again.num_computed_tokens = 32  # a cached prefix in the first two blocks: only the third is written
    assert not core._may_overtake(PrefillBatch([again], [3]))
    again.block_table = [fresh.block_table[0], fresh.block_table[1], reused[2]]
    assert not core._may_overtake(PrefillBatch([again], [3]))
    again.block_table = [reused[0], reused[1], fresh.block_table[2]]
    assert core._may_overtake(PrefillBatch([again], [3]))
    again.block_table, again.num_computed_tokens = [fresh.block_table[0], fresh.block_table[1], reused[2]], 0
    assert core._may_overtake(PrefillBatch([again], [2 * BS]))  # a chunk ending at a block's edge: not the next one
    core._rounds_completed = 4  # round 4 is done: its blocks are safe again...
    blocks.rounds_launched = 5  # ...while round 5 runs
    again.block_table, again.num_computed_tokens = reused, 0
    assert core._may_overtake(batch(again))
    echo = Sequence("echo", list(range(5, 40)), SamplingParams(max_tokens=1, prompt_logprobs=1))
    echo.block_table = reused
    assert not core._may_overtake(batch(echo))  # prompt logprobs: an eager prefill
    core.config.prefill_ahead = False  # switched off
    assert not core._may_overtake(batch(again))
    core.config.prefill_ahead = True
    core.worker.runner.prefill_graphs = None  # only prefill graphs overtake
    assert not core._may_overtake(batch(again))


def test_a_prefill_never_overtakes_the_first_rounds_into_a_block_freed_while_they_run(model_dir):
    """From a fresh engine: a request aborted while the first decode round runs, the next round
    launched ahead of the first's collection; a prefill into the aborted request's blocks may not
    overtake them (the first round may still write those blocks), one into other blocks may."""
    core = make_llm(model_dir, graphs=64, prefill_ahead=True).engine.core
    blocks = core.block_manager
    aborted, fresh = two_running_requests(blocks)
    reused = list(aborted.block_table)
    blocks.rounds_launched += 1  # the first round (EngineCore._launch counts each launch)
    blocks.free(aborted)  # aborted while it runs
    blocks.rounds_launched += 1  # the second, launched before the first is collected
    again = Sequence("again", list(range(5, 40)), GREEDY)
    again.block_table = reused
    assert not core._may_overtake(PrefillBatch([again], [35]))
    assert core._may_overtake(PrefillBatch([fresh], [35]))


def run_arrivals_on_cuda(model_dir, kind: str, arrive: str, seed: int, overtake: bool):
    """Twelve requests, four at a time: when one ends the next arrives, between steps or
    (arrive="while_waiting") through on_wait while the core waits for a round. Each round
    is made to look unfinished for its first WAIT_LOOKS looks, so that where requests arrive
    does not depend on the GPU's timing. overtake=False: prefills the engine lets overtake
    run on the current stream all the same (the same schedule, no overtaking).
    Returns (tokens per request, per prefill (a round was running, it may overtake, in on_wait), stats)."""
    lengths = [9, 17, 30, 12, 21, 26, 5, 14, 19, 8, 23, 11]
    if arrive == "between_steps":
        # 5-8 blocks each, 4 at a time, 30 blocks: a newcomer gets blocks freed a moment ago
        num_blocks, chunk = 31, 4
    else:  # a pool deep enough that a newcomer's blocks were freed before the running rounds
        lengths, num_blocks, chunk = [3 * n for n in lengths], 401, 32
    prompts = [[5 + (7 * i + 3 * j + 11 * seed) % 250 for j in range(60 + 4 * i)] for i in range(len(lengths))]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) if kind == "greedy" else
              SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=n, ignore_eos=True) for n in lengths]
    llm = LLM(str(model_dir), device="cuda", dtype="float32", block_size=BS, num_kv_blocks=num_blocks,
              decode_chunk=chunk, max_num_seqs=4, prefill_ahead=True)
    core = llm.engine.core
    decisions = []
    prefill, waiting, is_done, looks = core.worker.runner.prefill, [False], core.worker.graphs.is_done, {}

    def record(batch, overtake=False):
        decisions.append((core._rounds_completed < core.block_manager.rounds_launched, overtake, waiting[0]))
        return prefill(batch, overtake=overtake and overtake_allowed)

    def slow_is_done(handle) -> bool:
        looks[id(handle)] = looks.get(id(handle), 0) + 1
        return looks[id(handle)] > WAIT_LOOKS and is_done(handle)

    overtake_allowed = overtake
    core.worker.runner.prefill = record
    core.worker.graphs.is_done = slow_is_done
    seen, pending, ended = {}, list(range(len(lengths))), [None] * 3

    def take(outputs):
        for out in outputs:
            seen.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason is not None:
                ended.append(out.request_id)

    def arrivals():
        while ended and pending:  # one leaves, the next arrives
            ended.pop()
            i = pending.pop(0)
            core.add_request(f"r{i}", prompts[i], params[i])

    def on_wait(outputs):
        waiting[0] = True
        take(outputs)
        arrivals()

    if arrive == "while_waiting":  # arrivals come in there (and between steps when no round was waited for)
        core.on_wait = on_wait
    arrivals()
    while core.has_unfinished():
        waiting[0] = False
        take(core.step())
        if not waiting[0]:
            arrivals()
    assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks
    tokens, stats = [seen[f"r{i}"] for i in range(len(lengths))], core.stats()
    del llm, core
    return tokens, decisions, stats


WAIT_LOOKS = 4


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("arrive", ["between_steps", "while_waiting"])
@pytest.mark.parametrize("seed", [0, 1])
def test_prefills_overtaking_rounds_on_cuda_give_the_tokens_of_the_same_schedule_in_order(model_dir, kind, arrive,
                                                                                          seed):
    """The same requests and arrivals twice: once with the prefills the engine lets overtake
    run on the priority stream, ahead of the decode rounds queued on the device, and once run
    in stream order. The tokens are the same (a difference would be a race between the two
    streams: KV, static buffers, or a workspace they share), and some prefills of each kind
    happen: overtaking, and (between steps, in a pool so small that blocks freed a moment ago
    are handed out again) held back because a running round may still write a block. While
    waiting: newcomers are prefilled, ahead of the rounds, before the round is collected.
    (Where a newcomer is prefilled, in on_wait or the next step, may differ between the two
    runs: the in-order prefill waits for the round, and the round may end sooner.)"""
    import torch

    want, in_order, _ = run_arrivals_on_cuda(model_dir, kind, arrive, seed, overtake=False)
    got, decisions, stats = run_arrivals_on_cuda(model_dir, kind, arrive, seed, overtake=True)
    torch.cuda.empty_cache()
    report(dict(test="overtaking_prefills", kind=kind, arrive=arrive, seed=seed, prefills=len(decisions),
                ahead=sum(d[1] for d in decisions), while_waiting=sum(d[2] for d in decisions),
                ahead_while_waiting=sum(d[1] and d[2] for d in decisions), same=got == want,
                same_schedule=decisions == in_order))
    assert got == want
    assert stats.prefill_steps_ahead == sum(ahead for _, ahead, _ in decisions) > 0
    if arrive == "between_steps":
        assert any(running and not ahead for running, ahead, _ in decisions)
    else:
        assert any(ahead and in_wait for _, ahead, in_wait in decisions)


@pytest.mark.parametrize("prefill_ahead", [True, False])
def test_newcomers_are_prefilled_while_the_core_waits_for_a_round(model_dir, prefill_ahead):
    """EngineCore._serve_while_waiting (CPU: the round is made to look unfinished a few
    times): outputs made so far, first tokens included, go to on_wait before the round is
    collected; requests arriving there are admitted (with prefill_ahead, prefilled at once);
    and every request's tokens are an eager engine's."""
    from graphserve.engine.runner.cuda_graphs import GraphDecoder

    lengths = [9, 17, 30, 12, 21, 26, 5, 14]
    prompts = [PROMPTS[i % len(PROMPTS)][:20 + 4 * i] for i in range(len(lengths))]
    params = [SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=n, ignore_eos=True) for n in lengths]
    want = [o.token_ids for o in make_llm(model_dir, graphs=0).generate(prompts, params)]
    core = make_llm(model_dir, graphs=64, decode_chunk=4, max_num_seqs=4, prefill_ahead=prefill_ahead).engine.core
    core.worker.graphs = GraphDecoder(core.worker.runner, max_batch=4, max_steps=4, table_width=-(-core.max_model_len // BS),
                               use_cuda_graphs=False)
    core.worker.graphs.capture(progress=False)
    polls: dict[int, int] = {}

    def is_done(handle) -> bool:  # each round runs through three looks
        polls[id(handle)] = polls.get(id(handle), 0) + 1
        return polls[id(handle)] > 3

    core.worker.graphs.is_done = is_done
    seen, pending, ended, handed = {}, list(range(len(lengths))), [None] * 3, []

    def take(outputs, where):
        for out in outputs:
            seen.setdefault(out.request_id, []).extend(out.token_ids)
            handed.append((where, out.request_id, len(seen[out.request_id])))
            if out.finish_reason is not None:
                ended.append(out.request_id)

    def arrivals():
        while ended and pending:
            ended.pop()
            i = pending.pop(0)
            core.add_request(f"r{i}", prompts[i], params[i])

    core.on_wait = lambda outputs: (take(outputs, "waiting"), arrivals())
    arrivals()
    while core.has_unfinished():
        take(core.step(), "step")
        arrivals()
    assert [seen[f"r{i}"] for i in range(len(lengths))] == want
    # first tokens of newcomers went out while a round was still running
    assert any(where == "waiting" and n == 1 for where, _, n in handed)
    assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks


def test_the_captured_forward_with_the_triton_backend_gives_the_eager_logits(model_dir):
    """What a prefill graph captures (PrefillGraphs._forward over the static buffers, attention
    through the tile map), run here with the Triton attention backend in the interpreter: the
    logits of each sequence's last token equal an eager forward's, with tokens, sequences and
    tiles padded."""
    import torch

    from graphserve.engine.models.attention import TritonAttention
    from graphserve.engine.models.loading.loader import load_model
    from graphserve.engine.runner.model_runner import ModelRunner
    from graphserve.engine.sched.kv_cache import BlockManager, allocate_kv_cache

    model = load_model(str(model_dir), torch.float32, torch.device("cpu"), TritonAttention(BS), 512)
    kv = allocate_kv_cache(model.kv_args, 64, BS, torch.float32, torch.device("cpu"))
    blocks = BlockManager(64, BS)
    runner = ModelRunner(model, kv, blocks, torch.device("cpu"), (2,))
    graphs = PrefillGraphs(model, kv, BS, 64, 8, 32, torch.device("cpu"))
    graphs.capture(progress=False)
    gen = torch.Generator().manual_seed(0)
    for lens in ([37], [5, 20, 1], [64]):
        seqs = [Sequence(f"s{i}", torch.randint(3, 500, (n,), generator=gen).tolist(), GREEDY)
                for i, n in enumerate(lens)]
        for seq in seqs:
            blocks.allocate(seq, len(seq.token_ids))
        inputs = prefill_inputs(PrefillBatch(seqs, list(lens)), BS)
        with torch.inference_mode():
            eager = model.compute_logits(runner._prefill_forward(inputs)[torch.from_numpy(inputs.last_rows)])
            bucket = graphs.bucket_for(inputs.num_tokens, len(lens))
            graphs.run(inputs, bucket)  # stages the static buffers
            graphs._forward(bucket, graphs._meta(bucket))  # as captured: no host lengths, the tile map
            got = graphs.logits[:len(lens)]
        assert (got - eager).abs().max() < 1e-4 * eager.abs().max(), lens
        for seq in seqs:
            blocks.free(seq)
