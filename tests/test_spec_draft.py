"""Speculative decoding with a draft model (speculative_method "draft", engine/spec/draft_model.py): a
smaller model with the target's vocabulary proposes k greedy tokens a step from its own paged KV.
A user gets plain decoding's tokens (greedy and seeded sampling), drafts are accepted when the draft
model agrees (the target as its own draft: every one), neither KV pool keeps a block, and a draft
model the target cannot use is refused with the reason."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import make_tiny_model

from graphserve import LLM, EngineConfig, SamplingParams
from graphserve.engine.errors import InvalidConfigError
from graphserve.engine.runner.cuda_graphs import GraphDecoder

K = 4
ENGINE = dict(device="cpu", num_kv_blocks=256, decode_chunk=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(root / "target", "llama", seed=0)
    other = make_tiny_model(root / "one-layer", "llama", seed=1, num_hidden_layers=1)
    return target, other


@pytest.fixture(scope="module")
def prompts():
    gen = random.Random(0)
    base = [[gen.randrange(3, 259) for _ in range(n)] for n in (5, 20, 33)]
    return base + [p[:6] * 4 for p in base]


@pytest.fixture(scope="module")
def plain(models):
    return LLM(str(models[0]), **ENGINE)


def speculating(target, draft, **more) -> LLM:
    return LLM(str(target), **ENGINE, speculative_method="draft", draft_model=str(draft), num_speculative_tokens=K,
               speculative_max_batch=64, **more)


def outputs(llm: LLM, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]


def with_graph_decoders(llm: LLM, table_width: int = 32) -> None:
    """Both models' rounds through static graph decoders, as on CUDA (on CPU their rows run eagerly)."""
    drafter, core = llm.engine.core.speculation.drafter, llm.engine.core
    drafter.graphs = GraphDecoder(drafter.runner, max_batch=8, max_steps=K, table_width=table_width,
                                  use_cuda_graphs=False, variants=("greedy",))  # as the engine captures a draft model's
    drafter.graphs.capture(progress=False)
    core.worker.graphs = GraphDecoder(core.worker.runner, max_batch=64, max_steps=2, table_width=table_width, use_cuda_graphs=False)
    core.worker.graphs.capture(progress=False)


def check_nothing_left(llm: LLM, free: int, draft_free: int) -> None:
    spec = llm.engine.core.speculation
    assert llm.engine.block_manager.num_free_blocks == free
    assert spec.drafter.blocks.num_free_blocks == draft_free
    assert spec.num_tracked_requests == 0 and spec.drafter.num_tracked_requests == 0


@pytest.mark.parametrize("draft_kind", ["target_itself", "other_model"])
def test_draft_model_gives_plain_greedy_and_seeded_outputs(models, prompts, plain, draft_kind):
    target, other = models
    llm = speculating(target, target if draft_kind == "target_itself" else other)
    free, draft_free = llm.engine.block_manager.num_free_blocks, llm.engine.core.speculation.drafter.blocks.num_free_blocks
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True) for i in range(len(prompts))]
    assert outputs(llm, prompts, greedy) == outputs(plain, prompts, greedy)
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0
    if draft_kind == "target_itself":  # every draft is the target's own argmax
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert outputs(llm, prompts, seeded) == outputs(plain, prompts, seeded)
    assert llm.engine.stats().spec_draft_tokens > stats.spec_draft_tokens
    check_nothing_left(llm, free, draft_free)


def test_each_proposal_is_the_draft_models_own_greedy_continuation():
    """The draft model's KV stays right across verify steps that reject: each proposal equals the
    draft model's greedy continuation of the request's tokens, computed afresh. The embedded model
    (whose next token depends on its context) drafts for itself; sampled rows reject greedy drafts
    often, so its copies keep the KV of the accepted drafts only, and catch up after."""
    fresh = LLM(**ENGINE)
    path = fresh.engine.core.model_path
    llm = LLM(path, **ENGINE, speculative_method="draft", draft_model=path, num_speculative_tokens=K,
              speculative_max_batch=64)
    drafter = llm.engine.core.speculation.drafter
    proposals = []
    real = drafter.propose

    def propose(request_ids, max_drafts):
        drafts = real(request_ids, max_drafts)
        proposals.extend((list(drafter.seqs[rid].token_ids), d) for rid, d in zip(request_ids, drafts) if d)
        return drafts

    drafter.propose = propose
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]
    llm.generate(prompts, [SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True)
                           for i in range(len(prompts))])
    rejected = llm.engine.stats().spec_draft_tokens - llm.engine.stats().spec_accepted_tokens
    assert len(proposals) > 10 and rejected > 10
    checked = proposals[2::3]
    want = fresh.generate([tokens for tokens, _ in checked],
                          [SamplingParams(max_tokens=len(d), temperature=0, ignore_eos=True) for _, d in checked])
    assert [d for _, d in checked] == [o.token_ids for o in want]


def test_draft_rounds_through_the_drafts_graph_decoder(models, prompts, plain):
    """The draft model's k-step rounds through its decode graphs (as on CUDA; on CPU their static
    rows run eagerly), and the target's verify steps through its own. The target drafts for itself:
    every draft is right."""
    target, _ = models
    llm = speculating(target, target)
    with_graph_decoders(llm)
    drafter = llm.engine.core.speculation.drafter
    prefilled, real_prefill = [], drafter.runner.prefill
    drafter.runner.prefill = lambda batch: prefilled.extend(batch.chunk_lens) or real_prefill(batch)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert outputs(llm, prompts, greedy) == outputs(plain, prompts, greedy)
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0 and drafter.num_rounds > 0
    # every draft accepted, so each round leaves the k-th draft's KV to compute: decode steps do it,
    # and the draft model prefills each prompt once (up to the first token the target made)
    assert sum(prefilled) == sum(len(p) for p in prompts)


def test_drafts_left_on_the_device_give_plain_tokens_in_mixed_batches(models, prompts, plain):
    """Both graph decoders (so the drafts stay where the draft's graphs made them and the verify step
    reads them there): the target drafts for greedy rows (every draft right) and seeded ones (its
    greedy drafts often wrong) in one batch, rows drop out of drafting at different steps
    (max_tokens), and the tokens are plain decoding's."""
    target, _ = models
    llm = speculating(target, target)
    with_graph_decoders(llm)
    drafter = llm.engine.core.speculation.drafter
    free, draft_free = llm.engine.block_manager.num_free_blocks, drafter.blocks.num_free_blocks
    on_device, real = [], drafter.propose_on_device
    drafter.propose_on_device = lambda ids, n: on_device.append(len(ids)) or real(ids, n)
    params = [SamplingParams(max_tokens=12 + 5 * i, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    assert outputs(llm, prompts, params) == outputs(plain, prompts, params)
    stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens and on_device
    check_nothing_left(llm, free, draft_free)


def test_an_fp8_draft_model_drafts_for_a_full_precision_target(models, prompts, plain):
    """--draft-quantization fp8: the draft model's projections in FP8 (half the bytes of a draft
    step), the target's untouched; the tokens are plain decoding's, and an FP8 copy of the target
    agrees with it on most drafts."""
    target, _ = models
    llm = speculating(target, target, draft_quantization="fp8")
    draft_layer = llm.engine.core.speculation.drafter.runner.model.layers[0]
    assert draft_layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert llm.engine.core.worker.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert outputs(llm, prompts, greedy) == outputs(plain, prompts, greedy)
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens >= 0.8 * stats.spec_draft_tokens > 0


def test_requests_running_to_max_model_len_draft_within_it(models, prompts):
    """Requests that end at max_model_len: the draft model's last rounds write no KV past it (its
    graphs' block tables hold max_model_len tokens, as the engine sizes them), and the tokens are
    plain decoding's."""
    target, _ = models
    bs, max_len = 16, 64
    engine = dict(device="cpu", num_kv_blocks=64, block_size=bs, decode_chunk=2, max_model_len=max_len)
    plain = LLM(str(target), **engine)
    llm = LLM(str(target), **engine, speculative_method="draft", draft_model=str(target), num_speculative_tokens=K,
              speculative_max_batch=64)
    drafter = llm.engine.core.speculation.drafter
    drafter.graphs = GraphDecoder(drafter.runner, max_batch=8, max_steps=K, table_width=max_len // bs,
                                  use_cuda_graphs=False, variants=("greedy",))
    drafter.graphs.capture(progress=False)
    free, draft_free = llm.engine.block_manager.num_free_blocks, drafter.blocks.num_free_blocks
    prompts = [prompts[2][:n] for n in range(21, 31)]  # rounds of 5 tokens: every distance to the end
    params = [SamplingParams(max_tokens=max_len - len(p), temperature=0, ignore_eos=True) for p in prompts]
    want = outputs(plain, prompts, params)
    assert all(len(tokens) + len(p) == max_len for (tokens, _), p in zip(want, prompts))
    assert outputs(llm, prompts, params) == want
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    check_nothing_left(llm, free, draft_free)


@pytest.mark.parametrize("through_graphs", [False, True])
def test_preemption_with_a_draft_model_keeps_tokens_and_frees_both_pools(models, prompts, plain, through_graphs):
    """A target pool too small for the batch: sequences are preempted and recomputed while others
    speculate (some rows find no slots for their drafts); the draft model's copies follow their
    tokens. Through both graph decoders each verified row reads its own drafts on the device: the
    target drafting for itself, every draft is accepted."""
    target, other = models
    llm = LLM(str(target), device="cpu", num_kv_blocks=14, block_size=16, decode_chunk=2, max_model_len=96,
              speculative_method="draft", draft_model=str(target), num_speculative_tokens=K, speculative_max_batch=64)
    if through_graphs:
        with_graph_decoders(llm, table_width=96 // 16)
    free, draft_free = llm.engine.block_manager.num_free_blocks, llm.engine.core.speculation.drafter.blocks.num_free_blocks
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    assert outputs(llm, prompts, greedy) == outputs(plain, prompts, greedy)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    check_nothing_left(llm, free, draft_free)


def test_a_draft_model_setting_it_cannot_use_is_refused(models, tmp_path):
    target, _ = models
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(draft_model=str(target))
    with pytest.raises(ValueError, match="draft_quantization must be fp8"):
        EngineConfig(speculative_method="draft", draft_model=str(target), draft_quantization="int4")
    with pytest.raises(ValueError, match="draft_quantization goes with a draft model"):
        EngineConfig(speculative_method="ngram", draft_quantization="fp8")
    wide = make_tiny_model(tmp_path / "wide", "llama", vocab_size=1024)
    with pytest.raises(InvalidConfigError, match="vocabulary of 1024 tokens, more than the target's"):
        speculating(target, wide)
