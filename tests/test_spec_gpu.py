"""Speculative decoding on one GPU, through the decode CUDA graphs (GraphDecoder.verify_logits: one
decode step of B x (k + 1) rows): greedy outputs equal plain greedy decoding's at batches 1, 3, 17 and
64, with drafts that are mostly right (a recorded continuation, each token corrupted with probability
0.3) and with the n-gram drafter; every KV block comes back. A tiny float32 model: in float32 a row's
rounding at another row count stays far below its logits' gaps (in bf16 a random model's near-ties
can turn either way; benchmarks/speculative.py reports how often)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from tiny_models import make_tiny_model

from graphserve import LLM, SamplingParams
from graphserve.engine.spec.drafter import Drafter

pytestmark = pytest.mark.gpu

K = 4
PROMPT_LEN = 24
NEW = 48


class RecordedDrafter(Drafter):
    """Proposes each request's recorded continuation (known by its prompt), each token replaced by
    another with probability 1 - alpha."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], alpha: float, vocab: int):
        self.continuations, self.alpha, self.vocab = continuations, alpha, vocab
        self.rng = random.Random(0)
        self.state: dict[str, list] = {}

    def add_request(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.state[request_id] = [self.continuations[tuple(token_ids[:PROMPT_LEN])], len(token_ids) - PROMPT_LEN]

    def on_append(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.state[request_id][1] += len(token_ids)

    def on_finish(self, request_id: str) -> None:
        self.state.pop(request_id)

    def propose(self, request_ids: Sequence[str], max_drafts: Sequence[int]) -> list[list[int]]:
        out = []
        for rid, n in zip(request_ids, max_drafts):
            continuation, done = self.state[rid]
            out.append([t if self.rng.random() < self.alpha else (t + 1) % self.vocab
                        for t in continuation[done:done + n]])
        return out


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = make_tiny_model(tmp_path_factory.mktemp("spec-gpu") / "llama", "llama")
    # max_num_seqs: the decode graphs' largest bucket holds a verify step of 64 sequences x (k + 1)
    engine = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=64 * (K + 1), num_kv_blocks=2048,
                 prefix_caching=False, speculative_method="ngram", num_speculative_tokens=K)
    yield engine
    del engine
    torch.cuda.empty_cache()


@pytest.mark.parametrize("batch", [1, 3, 17, 64])
def test_speculative_greedy_through_the_graphs_equals_plain_greedy(llm, batch, monkeypatch):
    core = llm.engine.core
    spec, graphs = core.speculation, core.worker.graphs
    assert graphs is not None and graphs.verify_fits(batch, K)
    gen = random.Random(batch)
    prompts = [[gen.randrange(3, 259) for _ in range(PROMPT_LEN)] for _ in range(batch)]
    repeating = [p[:8] * 3 for p in prompts]  # the n-gram drafter finds these
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    free = core.block_manager.num_free_blocks

    spec.max_batch = 0  # plain decoding: overlapped K-step rounds through the graphs
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    plain_repeating = [o.token_ids for o in llm.generate(repeating, params)]
    spec.max_batch = None

    rows = []
    real = graphs.verify_logits
    monkeypatch.setattr(graphs, "verify_logits", lambda seqs, drafts, k, *more: rows.append(len(seqs)) or real(seqs, drafts, k, *more))
    ngram = spec.drafter
    spec.drafter = RecordedDrafter({tuple(p): t for p, t in zip(prompts, plain)}, 0.7, core.worker.runner.vocab_size)
    try:
        before = core.stats()
        forced = [o.token_ids for o in llm.generate(prompts, params)]
        after = core.stats()
    finally:
        spec.drafter = ngram
    by_ngram = [o.token_ids for o in llm.generate(repeating, params)]

    assert forced == plain
    assert by_ngram == plain_repeating
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    assert accepted > 0.3 * batch * NEW  # drafts were really accepted (about 1.8 a step of 2.8 tokens)
    assert max(rows) == batch  # a verify step held the whole batch
    assert core.block_manager.num_free_blocks == free
    assert spec.num_tracked_requests == 0


@pytest.mark.parametrize("draft_quantization", [None, "fp8"])
def test_a_draft_model_through_its_graphs_gives_plain_greedy(tmp_path, draft_quantization):
    """The target drafting for itself through the draft's own decode graphs (k-step rounds, and the
    one-step catch-up after a round accepted whole): plain greedy tokens, every draft accepted in
    float32 (most of them with an FP8 copy), and both KV pools whole again."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = make_tiny_model(tmp_path / "llama", "llama")
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=16 * (K + 1), num_kv_blocks=1024,
              prefix_caching=False, speculative_method="draft", draft_model=str(model_dir),
              draft_quantization=draft_quantization, num_speculative_tokens=K, speculative_max_batch=16)
    core = llm.engine.core
    spec = core.speculation
    assert spec.drafter.graphs is not None
    gen = random.Random(7)
    prompts = [[gen.randrange(3, 259) for _ in range(PROMPT_LEN)] for _ in range(16)]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    free, draft_free = core.block_manager.num_free_blocks, spec.drafter.blocks.num_free_blocks
    spec.max_batch = 0
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    spec.max_batch = 16
    for batch in (1, 3, 16):
        assert [o.token_ids for o in llm.generate(prompts[:batch], params)] == plain[:batch]
    stats = core.stats()
    assert stats.spec_accepted_tokens >= (0.98 if draft_quantization is None else 0.8) * stats.spec_draft_tokens > 0
    assert core.block_manager.num_free_blocks == free and spec.drafter.blocks.num_free_blocks == draft_free
    del llm
    torch.cuda.empty_cache()
