"""Speculative decoding's verify step on paged KV (ModelRunner.verify) and its rollback
(BlockManager.reserve_draft_slots, roll_back_drafts): the verify logits are those of plain decode steps
fed the same tokens (CPU backend; Triton kernels in the interpreter), a draft-verify-accept loop gives
plain greedy's tokens, and rejected drafts leave no block behind."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_model

from graphserve import LLM, SamplingParams
from graphserve.engine.models.attention import TritonAttention
from graphserve.engine.models.loading.loader import load_model
from graphserve.engine.request import Sequence
from graphserve.engine.runner.cuda_graphs import GraphDecoder
from graphserve.engine.runner.model_runner import ModelRunner
from graphserve.engine.sample.rejection_sampler import verify_drafts
from graphserve.engine.sched.kv_cache import BlockManager, allocate_kv_cache
from graphserve.engine.sched.scheduler import DecodeRound, PrefillBatch
from graphserve.engine.spec.drafter import DeviceDrafts, Drafter, pack_drafts
from graphserve.engine.spec.ngram import NgramDrafter
from graphserve.engine.spec.speculative_decoder import SpeculativeDecoder

BS = 16
CPU = torch.device("cpu")
VOCAB = 512
# prompt lengths around block edges: after the first token, the last token sits at positions 5, 14, 15,
# 30, 44, 47, and the drafts after it run into the next block in rows 2 to 5
PROMPT_LENS = (5, 14, 15, 30, 44, 47)
NUM_DRAFTS = (3, 0, 4, 2, 5, 1)
RIGHT_ROWS = (0, 3, 4)  # their drafts are the greedy continuation; the others' are random


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def make_prompts(lens, seed: int) -> list[list[int]]:
    gen = random.Random(seed)
    return [[gen.randrange(3, 259) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), device="cpu", block_size=BS, num_kv_blocks=64)


# ---- teacher-forced: verify's logits are plain decode's --------------------------------------


def fresh_runner(model, num_blocks: int = 40) -> ModelRunner:
    kv = allocate_kv_cache(model.kv_args, num_blocks, BS, torch.float32, CPU)
    return ModelRunner(model, kv, BlockManager(num_blocks, BS), CPU, eos_ids=(2,))


def decoding(runner: ModelRunner, prompts: list[list[int]]) -> list[Sequence]:
    """Sequences whose prompts are prefilled and whose first (greedy) token is appended: each has
    every token but its last in the KV cache, as between two decode steps."""
    seqs = [Sequence(f"r{i}", p, greedy(64)) for i, p in enumerate(prompts)]
    for seq in seqs:
        runner.blocks.allocate(seq, seq.num_tokens)
    first = runner.prefill(PrefillBatch(seqs, [s.num_tokens for s in seqs]))
    for seq in seqs:
        seq.token_ids += first[seq.request_id].tokens
    assert all(s.num_computed_tokens == s.num_tokens - 1 for s in seqs)
    return seqs


@torch.inference_mode()
def teacher_forced_decode(runner: ModelRunner, seqs: list[Sequence], drafts: list[list[int]]) -> list[torch.Tensor]:
    """Per row, the logits [len(drafts) + 1, V] of plain one-token decode steps (eager rounds of one
    step) fed its last token, then its drafts one at a time."""
    base = [list(s.token_ids) for s in seqs]
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    for j in range(max(map(len, drafts)) + 1):
        rows = [i for i, d in enumerate(drafts) if j <= len(d)]
        for i in rows:
            seqs[i].token_ids = base[i] + drafts[i][:j]  # the token fed in at this step is the last one
            runner.blocks.allocate(seqs[i], seqs[i].num_tokens)
        step = runner.decode_forward(runner.prepare_decode(DecodeRound([seqs[i] for i in rows], 1)))
        for r, i in enumerate(rows):
            logits[i].append(step[r].float())
    for seq, tokens in zip(seqs, base):
        seq.token_ids = tokens
    return [torch.stack(rows) for rows in logits]


def kv_at(runner: ModelRunner, seq: Sequence, num_positions: int) -> torch.Tensor:
    """[layers, 2, num_positions, kv heads, head dim]: the sequence's KV read through its block table."""
    pos = torch.arange(num_positions)
    slots = torch.tensor(seq.block_table)[pos // BS] * BS + pos % BS
    return torch.stack([torch.stack([cache.flatten(0, 1)[slots] for cache in layer]) for layer in runner.kv_caches])


def drafts_for(continuations: list[list[int]], seed: int) -> list[list[int]]:
    """NUM_DRAFTS[i] drafts per row: the greedy continuation in RIGHT_ROWS, random tokens elsewhere."""
    gen = random.Random(seed)
    return [continuations[i][:n] if i in RIGHT_ROWS else [gen.randrange(3, VOCAB) for _ in range(n)]
            for i, n in enumerate(NUM_DRAFTS)]


def graph_verify(runner: ModelRunner):
    """The verify step through the decode graphs' static rows (GraphDecoder.verify_logits; on CPU the
    same buffers run eagerly), as a CUDA engine with graphs runs it."""
    decoder = GraphDecoder(runner, max_batch=64, max_steps=2, table_width=8, use_cuda_graphs=False)
    decoder.capture(progress=False)
    return lambda seqs, drafts, k: decoder.verify_logits(seqs, drafts, k).float()


def check_verify_matches_decode(model, prompts, continuations, through_graphs: bool = False):
    reference, verifier = fresh_runner(model), fresh_runner(model)
    verify = graph_verify(verifier) if through_graphs else verifier.verify
    ref_seqs, seqs = decoding(reference, prompts), decoding(verifier, prompts)
    assert [s.token_ids for s in seqs] == [s.token_ids for s in ref_seqs]
    drafts = drafts_for(continuations, seed=1)
    want = teacher_forced_decode(reference, ref_seqs, drafts)

    free_before = verifier.blocks.num_free_blocks
    for seq, d in zip(seqs, drafts):
        assert verifier.blocks.reserve_draft_slots(seq, len(d))
    assert verifier.blocks.num_free_blocks == free_before - 4  # rows 2 to 5 cross into a new block
    got = verify(seqs, drafts, 6)
    assert got.shape == (len(seqs), 7, VOCAB) and got.dtype == torch.float32
    for i, (seq, d) in enumerate(zip(seqs, drafts)):
        torch.testing.assert_close(got[i, :len(d) + 1], want[i], rtol=1e-5, atol=1e-5)
        if not through_graphs:  # the graphs' padding positions score garbage, never read
            assert not got[i, len(d) + 1:].any()
        # the KV written at the last token's and the drafts' positions is decode's too
        torch.testing.assert_close(kv_at(verifier, seq, seq.num_tokens + len(d)),
                                   kv_at(reference, ref_seqs[i], seq.num_tokens + len(d)), rtol=1e-5, atol=1e-6)
    # the greedy drafts of the right rows are accepted (a check that they are right: the
    # acceptance test below relies on rows like them)
    tokens, counts = pack_drafts(drafts, 6)
    accepted = verify_drafts(got, tokens, counts, torch.zeros(len(seqs)), torch.zeros(len(seqs), dtype=torch.int64),
                             torch.ones(len(seqs), dtype=torch.int64)).num_accepted.tolist()
    assert [accepted[i] for i in RIGHT_ROWS] == [NUM_DRAFTS[i] for i in RIGHT_ROWS]


@pytest.mark.parametrize("through_graphs", [False, True], ids=["eager", "graph_rows"])
def test_verify_logits_equal_plain_decode_steps_cpu_backend(llm, through_graphs):
    prompts = make_prompts(PROMPT_LENS, seed=0)
    continuations = [o.token_ids[1:] for o in llm.generate(prompts, greedy(8))]
    check_verify_matches_decode(llm.engine.core.worker.model, prompts, continuations, through_graphs)


@pytest.mark.parametrize("through_graphs", [False, True], ids=["eager", "graph_rows"])
def test_verify_logits_equal_plain_decode_steps_triton_backend(llm, model_dir, monkeypatch, through_graphs):
    """The CUDA code path in Triton's interpreter: prefill attention over the draft chunk (eager) or
    the decode kernels over one row per position (graph rows) against the paged decode attention
    kernel, skinny GEMMs against the fused norm + GEMV + rotary + KV store."""
    from graphserve.engine.models import layers

    prompts = make_prompts(PROMPT_LENS, seed=0)
    continuations = [o.token_ids[1:] for o in llm.generate(prompts, greedy(8))]
    model = load_model(model_dir, torch.float32, CPU, TritonAttention(BS), 128)
    monkeypatch.setattr(layers, "_triton", lambda x: True)
    check_verify_matches_decode(model, prompts, continuations, through_graphs)


def test_verify_refuses_a_sequence_without_reserved_slots_or_not_decoding(llm):
    runner = fresh_runner(llm.engine.core.worker.model)
    (seq,) = decoding(runner, make_prompts([16], seed=3))  # 17 tokens: its 2 blocks hold 32 slots
    with pytest.raises(ValueError, match="no KV slots"):
        runner.verify([seq], [[5] * 16])
    seq.num_computed_tokens -= 1
    with pytest.raises(ValueError, match="all but the last"):
        runner.verify([seq], [[5]])


# ---- draft, verify, accept, roll back: plain greedy's tokens ---------------------------------


class SpecStats:
    def __init__(self) -> None:
        self.drafted = self.accepted = self.all_accepted = self.none_accepted = self.blocks_returned = 0


def speculative_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int, k: int, propose) -> tuple[list, SpecStats]:
    """Greedy decoding by verify steps alone: admission and prefill through the engine's scheduler
    and runner, then per step `propose(seqs, limits)` drafts (at most limits[i] for row i), one
    verify pass, acceptance at temperature 0, the accepted drafts and the token after them
    appended, and the rejected ones rolled back."""
    core = llm.engine.core
    runner, blocks, scheduler = core.worker.runner, core.block_manager, core.scheduler
    seqs = [Sequence(f"spec{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    while any(s.in_prefill for s in seqs):
        batch = scheduler.schedule_prefill()
        for rid, step in runner.prefill(batch).items():
            next(s for s in seqs if s.request_id == rid).token_ids += step.tokens
        for seq in batch.seqs:
            blocks.register(seq)
    stats = SpecStats()
    live = list(seqs)
    while live:
        limits = [min(k, max_tokens - s.num_output_tokens - 1) for s in live]
        drafts = propose(live, limits)
        for seq, proposal, limit in zip(live, drafts, limits):
            assert len(proposal) <= limit
            assert blocks.reserve_draft_slots(seq, len(proposal))
        logits = runner.verify(live, drafts, k)
        tokens, counts = pack_drafts(drafts, k)
        out = verify_drafts(logits, tokens, counts, torch.zeros(len(live)), torch.zeros(len(live), dtype=torch.int64),
                            torch.tensor([s.num_output_tokens for s in live]))
        for seq, proposal, n, row in zip(live, drafts, out.num_accepted.tolist(), out.token_ids.tolist()):
            seq.token_ids += row[:n + 1]
            table_len = len(seq.block_table)
            blocks.roll_back_drafts(seq)
            stats.blocks_returned += table_len - len(seq.block_table)
            stats.drafted += len(proposal)
            stats.accepted += n
            stats.all_accepted += bool(proposal) and n == len(proposal)
            stats.none_accepted += bool(proposal) and n == 0
            if seq.num_output_tokens >= max_tokens:
                scheduler.finish(seq)
        live = [s for s in live if not s.is_finished]
    return [s.output_token_ids for s in seqs], stats


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_ngram_drafts_give_plain_greedy_tokens(model_dir, caching):
    """Repetitive prompts (a phrase repeated, a shared first block), so n-gram lookup finds
    continuations; with the prefix cache the shared block is never written."""
    llm = LLM(str(model_dir), device="cpu", block_size=BS, num_kv_blocks=64, prefix_caching=caching)
    blocks = llm.engine.block_manager
    shared = make_prompts([BS], seed=5)[0]
    phrases = make_prompts([3, 5, 7, 4], seed=6)
    prompts = [shared + phrase * reps for phrase, reps in zip(phrases, (9, 4, 3, 6))]
    want = [o.token_ids for o in llm.generate(prompts, greedy(40))]
    free_at_start = blocks.num_free_blocks

    drafter = NgramDrafter(min_n=1, max_n=3)
    for i, prompt in enumerate(prompts):
        drafter.add_request(f"spec{i}", prompt)
    seen: dict[str, int] = {}
    cached_block = kv_before = None

    def propose(seqs, limits):
        nonlocal cached_block, kv_before
        if caching and cached_block is None:  # after admission: the first prompt block, shared by all
            cached_block = seqs[0].block_table[0]
            assert all(s.block_table[0] == cached_block for s in seqs)
            kv_before = [c[cached_block].clone() for layer in llm.engine.core.worker.kv_caches for c in layer]
        for seq in seqs:  # the tokens appended since the last step
            drafter.on_append(seq.request_id, seq.token_ids[seen.get(seq.request_id, len(seq.prompt_token_ids)):])
            seen[seq.request_id] = seq.num_tokens
        return drafter.propose([s.request_id for s in seqs], limits)

    got, stats = speculative_greedy(llm, prompts, 40, 4, propose)
    assert got == want
    assert stats.accepted > 0 and stats.none_accepted > 0
    assert blocks.num_free_blocks == free_at_start
    if caching:
        kv_after = [c[cached_block] for layer in llm.engine.core.worker.kv_caches for c in layer]
        assert all(torch.equal(a, b) for a, b in zip(kv_before, kv_after))


def test_right_partly_wrong_and_missing_drafts_give_plain_greedy_tokens(llm):
    """Drafts from plain greedy's own output, some cut short, some corrupted at a random place,
    some rows without drafts: every acceptance length from 0 to k occurs, and the tokens are
    plain greedy's. Blocks taken for rejected drafts that run into a new block come back."""
    prompts = make_prompts((9, 15, 29, 31, 40, 2), seed=7)
    max_tokens, k = 36, 5
    want = [o.token_ids for o in llm.generate(prompts, greedy(max_tokens))]
    blocks = llm.engine.block_manager
    free_at_start = blocks.num_free_blocks
    gen = random.Random(8)
    accepted_lengths = set()

    def propose(seqs, limits):
        drafts = []
        for seq, limit in zip(seqs, limits):
            truth = want[int(seq.request_id[4:])][seq.num_output_tokens:][:gen.randint(0, limit)]
            if truth and gen.random() < 0.6:
                at = gen.randrange(len(truth))
                truth[at] = (truth[at] + gen.randrange(1, VOCAB)) % VOCAB
                accepted_lengths.add(at)
            elif truth:
                accepted_lengths.add(len(truth))
            drafts.append(truth)
        return drafts

    got, stats = speculative_greedy(llm, prompts, max_tokens, k, propose)
    assert got == want
    assert accepted_lengths >= set(range(k + 1))
    assert stats.all_accepted > 0 and stats.none_accepted > 0 and stats.blocks_returned > 0
    assert blocks.num_free_blocks == free_at_start


# ---- the block accounting alone ---------------------------------------------------------------


def decoding_sequence(blocks: BlockManager, num_tokens: int) -> Sequence:
    seq = Sequence("s", list(range(3, 3 + num_tokens)), greedy(100))
    blocks.allocate(seq, num_tokens - 1)
    seq.num_computed_tokens = num_tokens - 1
    return seq


def test_a_rejected_draft_run_into_a_new_block_gives_the_block_back():
    blocks = BlockManager(8, BS)
    start = blocks.num_free_blocks
    seq = decoding_sequence(blocks, 31)  # positions 0..29 computed, the last token goes at 30
    assert len(seq.block_table) == 2
    assert blocks.reserve_draft_slots(seq, 4)  # positions 30..34: a third block
    assert len(seq.block_table) == 3 and blocks.num_free_blocks == start - 3
    seq.token_ids.append(7)  # every draft rejected: only the corrected token
    blocks.roll_back_drafts(seq)
    assert seq.num_computed_tokens == 31 and len(seq.block_table) == 2
    assert blocks.num_free_blocks == start - 2
    blocks.free(seq)
    assert blocks.num_free_blocks == start


def test_accepted_drafts_across_a_block_edge_keep_their_block():
    blocks = BlockManager(8, BS)
    start = blocks.num_free_blocks
    seq = decoding_sequence(blocks, 31)
    assert blocks.reserve_draft_slots(seq, 4)
    seq.token_ids += [7, 8, 9, 10]  # 3 drafts accepted, then the correction
    blocks.roll_back_drafts(seq)
    assert seq.num_computed_tokens == 34 and len(seq.block_table) == 3
    blocks.free(seq)
    assert blocks.num_free_blocks == start


def test_reserving_draft_slots_takes_nothing_when_the_pool_is_short():
    blocks = BlockManager(3, BS)  # two usable blocks
    seq = decoding_sequence(blocks, 17)
    assert len(seq.block_table) == 1 and blocks.num_free_blocks == 1
    assert blocks.reserve_draft_slots(seq, 15)  # positions 16..31: the second block
    seq.token_ids.append(7)
    blocks.roll_back_drafts(seq)
    assert not blocks.reserve_draft_slots(seq, 16)  # positions 17..33: a third block, none left
    assert len(seq.block_table) == 2 and blocks.num_free_blocks == 0


class _DeviceRowDrafter(Drafter):
    """Drafts left on the device: request i of a proposal gets [10 i, 10 i + 1, ...]."""

    def add_request(self, request_id, token_ids):
        pass

    def on_append(self, request_id, token_ids):
        pass

    def on_finish(self, request_id):
        pass

    def propose(self, request_ids, max_drafts):
        raise AssertionError("the drafts stay on the device")

    def propose_on_device(self, request_ids, max_drafts):
        tokens = torch.tensor([[10 * i + j for j in range(4)] for i in range(len(request_ids))])
        return DeviceDrafts(list(max_drafts), list(range(len(request_ids))), tokens)


def test_a_plan_gives_each_verified_row_its_own_drafts_from_the_device(llm):
    """Drafts left on the device: a row between two others finds no KV slots for its drafts, so it
    decodes plainly, and the rows around it are verified with their own drafts."""
    blocks = BlockManager(4, BS)  # three usable blocks, one for each sequence
    seqs = []
    for i, n in enumerate((10, 16, 5)):  # the second one's drafts would need a block of their own
        seq = Sequence(f"r{i}", list(range(3, 3 + n)), greedy(100))
        blocks.allocate(seq, n - 1)
        seq.num_computed_tokens = n - 1
        seqs.append(seq)
    spec = SpeculativeDecoder(_DeviceRowDrafter(), 4, llm.engine.core.worker.runner, blocks, max_model_len=256)
    plan = spec.plan(seqs, on_device=True)
    assert plan.verify_seqs == [seqs[0], seqs[2]] and plan.decode_seqs == [seqs[1]]
    assert [len(d) for d in plan.drafts] == [4, 4]
    assert plan.device_tokens.tolist() == [[0, 1, 2, 3], [20, 21, 22, 23]]
