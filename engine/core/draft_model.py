"""A draft model as a drafter: a smaller model with the target's vocabulary proposes each request's
next k tokens greedily.

It keeps its own copy of each request (a Sequence of the request's tokens), its own paged KV pool
(BlockManager) and runner, and on CUDA its own decode graphs, captured for rounds of k steps. A
propose first computes the KV of the tokens it has not seen in one prefill step (a new request's
prompt; after a verify step, the accepted token its round did not feed), then runs one greedy decode
round of k steps over every row that asked: the k tokens are the drafts. The round feeds the last
token and the first k - 1 drafts, so after the verify step the KV of the drafts the target accepted
stays valid (on_append counts them) and the rest is overwritten later; blocks past a request's
tokens go back to the pool. When the target accepted all k drafts, the k-th one's KV is missing:
one decode step of the graphs (the row as it was before its last token) computes it, launched
just before the round (an eager one-token prefill would launch the model op by op).

Greedy drafts are a deterministic drafter's (one-hot q): acceptance.py's exact rule applies, and a
request gets the tokens it would get without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from graphserve.engine.request import SamplingParams, Sequence
from graphserve.engine.runner.cuda_graphs import GraphDecoder
from graphserve.engine.runner.model_runner import ModelRunner
from graphserve.engine.sched.kv_cache import BlockManager
from graphserve.engine.sched.scheduler import DecodeRound, PrefillBatch
from graphserve.engine.spec.drafter import Drafter


class DraftModelDrafter(Drafter):
    def __init__(self, runner: ModelRunner, k: int, max_model_len: int, graphs: GraphDecoder | None = None,
                 max_prefill_tokens: int = 8192):
        self.runner = runner
        self.blocks: BlockManager = runner.blocks
        self.k = k
        self.graphs = graphs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.params = SamplingParams(max_tokens=max_model_len, temperature=0, ignore_eos=True)  # of catch-up steps
        self.seqs: dict[str, Sequence] = {}
        self.fed: dict[str, list[int]] = {}  # request id -> the drafts its last round fed in (k - 1)
        self.num_rounds = 0  # draft decode rounds run (one per propose that drafted)

    def add_request(self, request_id: str, token_ids: Seq[int]) -> None:
        # a round writes KV only below max_model_len: plan_steps stops a row at its max_tokens
        params = SamplingParams(max_tokens=max(1, self.max_model_len - len(token_ids)), temperature=0,
                                ignore_eos=True)
        self.seqs[request_id] = Sequence(request_id, list(token_ids), params)

    def on_append(self, request_id: str, token_ids: Seq[int]) -> None:
        seq = self.seqs[request_id]
        fed = self.fed.pop(request_id, None)
        start = seq.num_tokens
        seq.token_ids += token_ids
        if fed is not None and seq.num_computed_tokens == start - 1:
            # the round computed the last token's KV and that of each fed draft the target accepted
            matched = next((i for i, (a, b) in enumerate(zip(fed, token_ids)) if a != b), min(len(fed), len(token_ids)))
            seq.num_computed_tokens = min(start + matched, seq.num_tokens - 1)
        self.blocks.trim(seq, seq.num_tokens)

    def on_finish(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        self.fed.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)

    @property
    def num_tracked_requests(self) -> int:
        return len(self.seqs)

    @torch.inference_mode()
    def propose(self, request_ids: Seq[str], max_drafts: Seq[int]) -> list[list[int]]:
        rows = [self.seqs[rid] for rid, n in zip(request_ids, max_drafts) if n > 0]
        # every row needs its KV up to its last token, and slots for the round's k steps (the last
        # token and k - 1 drafts fed in: what a verify step of k - 1 drafts writes), within max_model_len
        rows = [s for s in rows if s.num_tokens < self.max_model_len
                and self.blocks.reserve_draft_slots(s, self._drafts_fed(s))]
        self._catch_up(rows)
        drafts: dict[str, list[int]] = {}
        if rows:
            tokens = self._decode(DecodeRound(rows, self.k), collect=True)
            self.num_rounds += 1
            for seq in rows:
                drafts[seq.request_id] = tokens[seq.request_id].tokens
                self.fed[seq.request_id] = drafts[seq.request_id][:self._drafts_fed(seq)]
        return [drafts.get(rid, [])[:n] for rid, n in zip(request_ids, max_drafts)]

    def _drafts_fed(self, seq: Sequence) -> int:
        """Drafts a round feeds `seq` with their KV written: k - 1, fewer near max_model_len."""
        return min(self.k, self.max_model_len - seq.num_tokens) - 1

    def _decode(self, rnd: DecodeRound, collect: bool) -> dict | None:
        """A greedy round through the graphs where it fits them (not waited for unless `collect`),
        else eagerly."""
        if self.graphs is not None and len(rnd.seqs) <= self.graphs.max_bucket:
            handle = self.graphs.launch(rnd)
            return self.graphs.collect(handle)[0] if collect else None
        return self.runner.decode(rnd)

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Compute the KV of every token of `seqs` but the last that the draft model has not: one
        token behind (every draft of the last round accepted), one decode step of the row as it was
        before its last token (its output ignored); further behind (a prompt, tokens decoded without
        speculation), a prefill in steps of at most max_prefill_tokens tokens."""
        one_behind = [s for s in seqs if s.num_computed_tokens == s.num_tokens - 2]
        if one_behind:
            self._decode(DecodeRound([_before_last_token(s, self.params) for s in one_behind], 1), collect=False)
            for seq in one_behind:
                seq.num_computed_tokens += 1
        while True:
            batch, lens, budget = [], [], self.max_prefill_tokens
            for seq in seqs:
                behind = seq.num_tokens - 1 - seq.num_computed_tokens
                if behind > 0 and budget > 0:
                    batch.append(seq)
                    lens.append(min(behind, budget))
                    budget -= lens[-1]
            if not batch:
                return
            for seq in batch:  # no first token is sampled: the chunk stops before the last token
                seq.num_prefill_tokens = seq.num_tokens
            self.runner.prefill(PrefillBatch(batch, lens))


def _before_last_token(seq: Sequence, params: SamplingParams) -> Sequence:
    """A decoding view of `seq` without its last token, sharing its block table: a decode step of it
    writes the KV of the token before the last (`params` leave it room for that step)."""
    view = Sequence(seq.request_id, seq.token_ids[:-2], params)
    view.token_ids.append(seq.token_ids[-2])
    view.block_table = seq.block_table
    view.num_computed_tokens = seq.num_tokens - 2
    return view
