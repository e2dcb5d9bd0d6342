"""The draft-model drafter: a smaller model with the target's vocabulary proposes the next k tokens greedily.

It keeps its own copy of each request (a Sequence of the request's tokens), its own paged KV pool
(BlockManager) and runner, and on CUDA its own decode graphs, captured for rounds of k steps. A
propose first computes the KV of the tokens it has not seen in one prefill step (a new request's
prompt; after a verify step, the accepted token its round did not feed), then runs one greedy decode
round of k steps over every row that asked: the k tokens are the drafts. The round feeds the last
token and the first k - 1 drafts, so after the verify step the KV of the drafts the target accepted
stays valid (on_append counts them) and the rest is overwritten later; blocks past a request's
tokens go back to the pool. When the target accepted all k drafts, the k-th one's KV is missing:
an extra row of the round's first step computes it (the request as it was before its last token,
sharing its block table; each layer writes every row's K/V before any row attends, so the real
row reads it in that same step). Its later steps write nothing. A separate step would cost a
launch and a read of the weights; an eager one-token prefill would launch the model op by op.

Greedy drafts are a deterministic drafter's (one-hot q): engine/sample/rejection_sampler.py's exact rule applies, and a
request gets the tokens it would get without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from graphserve.engine.request import SamplingParams, Sequence
from graphserve.engine.runner.cuda_graphs import GraphDecoder
from graphserve.engine.runner.host_slots import RoundHandle
from graphserve.engine.runner.model_runner import ModelRunner
from graphserve.engine.sched.kv_groups import KVGroups
from graphserve.engine.sched.scheduler import DecodeRound, PrefillBatch
from graphserve.engine.spec.drafter import DeviceDrafts, Drafter


class DraftModelDrafter(Drafter):
    def __init__(self, runner: ModelRunner, k: int, max_model_len: int, graphs: GraphDecoder | None = None,
                 max_prefill_tokens: int = 8192):
        self.runner = runner
        self.blocks: KVGroups = runner.blocks
        self.k = k
        self.graphs = graphs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.seqs: dict[str, Sequence] = {}
        self.fed: dict[str, list[int]] = {}  # request id -> the drafts its last round fed in (k - 1)
        # the round launched last and not read yet: (its handle, or its tokens if it ran eagerly;
        # its rows; how many catch-up views came before them)
        self._round: tuple[RoundHandle | dict, list[Sequence], int] | None = None
        self.num_rounds = 0  # draft decode rounds run (one per propose that drafted)

    def add_request(self, request_id: str, token_ids: Seq[int]) -> None:
        # a round writes KV only below max_model_len: plan_steps stops a row at its max_tokens
        params = SamplingParams(max_tokens=max(1, self.max_model_len - len(token_ids)), temperature=0,
                                ignore_eos=True)
        self.seqs[request_id] = Sequence(request_id, list(token_ids), params)

    def on_append(self, request_id: str, token_ids: Seq[int]) -> None:
        self._read_round()
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
        self._read_round()
        seq = self.seqs.pop(request_id, None)
        self.fed.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq)

    @property
    def num_tracked_requests(self) -> int:
        return len(self.seqs)

    @torch.inference_mode()
    def propose(self, request_ids: Seq[str], max_drafts: Seq[int]) -> list[list[int]]:
        self._launch(request_ids, max_drafts)
        drafts = self._read_round()
        return [drafts.get(rid, [])[:n] for rid, n in zip(request_ids, max_drafts)]

    @torch.inference_mode()
    def propose_on_device(self, request_ids: Seq[str], max_drafts: Seq[int]) -> DeviceDrafts | None:
        """The round's drafts where its graphs leave them (a copy, in stream order); read on the host
        at the next hook, once the verify step has waited for them."""
        if self.graphs is None:
            return None
        rows = self._launch(request_ids, max_drafts)
        if self._round is None:
            return DeviceDrafts([0] * len(request_ids), [0] * len(request_ids),
                                torch.zeros(1, self.k, dtype=torch.int64, device=self.runner.device))
        result, _, offset = self._round
        if isinstance(result, dict):  # an eager round (more rows than the graphs hold): on the host already
            tokens = torch.tensor([result[s.request_id].tokens for s in rows]).to(self.runner.device)
        else:
            tokens = self.graphs.buffers.out_tokens[:self.k, offset:offset + len(rows)].T.contiguous()
        row_of = {s.request_id: i for i, s in enumerate(rows)}
        return DeviceDrafts([n if rid in row_of else 0 for rid, n in zip(request_ids, max_drafts)],
                            [row_of.get(rid, 0) for rid in request_ids], tokens)

    def _launch(self, request_ids: Seq[str], max_drafts: Seq[int]) -> list[Sequence]:
        """Launch one round for the rows that asked and have room; returns them."""
        self._read_round()  # the last round's, if nothing has read it yet
        rows = [self.seqs[rid] for rid, n in zip(request_ids, max_drafts) if n > 0]
        # every row needs its KV up to its last token, and slots for the round's k steps (the last
        # token and k - 1 drafts fed in: what a verify step of k - 1 drafts writes), within max_model_len
        rows = [s for s in rows if s.num_tokens < self.max_model_len
                and self.blocks.reserve_draft_slots(s, self._drafts_fed(s))]
        behind = self._catch_up(rows)
        if rows:
            rnd = DecodeRound(behind + rows, self.k)
            fits = self.graphs is not None and len(rnd.seqs) <= self.graphs.max_bucket
            self._round = (self.graphs.launch(rnd) if fits else self.runner.decode(rnd), rows, len(behind))
            self.num_rounds += 1
        return rows

    def _read_round(self) -> dict[str, list[int]]:
        """The drafts of the round launched last (waiting for it if need be), once; records the
        drafts each row fed in, which on_append compares with the tokens accepted."""
        if self._round is None:
            return {}
        result, rows, _ = self._round
        self._round = None
        tokens = result if isinstance(result, dict) else self.graphs.collect(result)[0]
        drafts = {}
        for seq in rows:
            drafts[seq.request_id] = tokens[seq.request_id].tokens
            self.fed[seq.request_id] = drafts[seq.request_id][:self._drafts_fed(seq)]
        return drafts

    def _drafts_fed(self, seq: Sequence) -> int:
        """Drafts a round feeds `seq` with their KV written: k - 1, fewer near max_model_len."""
        return min(self.k, self.max_model_len - seq.num_tokens) - 1

    def _catch_up(self, seqs: list[Sequence]) -> list[Sequence]:
        """Compute the KV of every token of `seqs` but the last that the draft model has not. Rows
        one token behind (every draft of the last round accepted) get it from the round: returned
        are their views before the last token, to ride along as extra rows (else, when the round
        would outgrow the graphs, one decode step of them runs here). Further behind (a prompt,
        tokens decoded without speculation): a prefill in steps of at most max_prefill_tokens tokens."""
        one_behind = [s for s in seqs if s.num_computed_tokens == s.num_tokens - 2]
        views = [_before_last_token(s) for s in one_behind]
        for seq in one_behind:
            seq.num_computed_tokens += 1
        if views and self.graphs is not None and len(views) + len(seqs) > self.graphs.max_bucket:
            rnd = DecodeRound(views, 1)  # its output is not read
            if len(views) <= self.graphs.max_bucket:
                self.graphs.launch(rnd)
            else:
                self.runner.decode(rnd)
            views = []
        while True:
            batch, lens, budget = [], [], self.max_prefill_tokens
            for seq in seqs:
                behind = seq.num_tokens - 1 - seq.num_computed_tokens
                if behind > 0 and budget > 0:
                    batch.append(seq)
                    lens.append(min(behind, budget))
                    budget -= lens[-1]
            if not batch:
                return views
            for seq in batch:  # no first token is sampled: the chunk stops before the last token
                seq.num_prefill_tokens = seq.num_tokens
            self.runner.prefill(PrefillBatch(batch, lens))


CATCH_UP_SUFFIX = "#catch-up"  # ends a view's request id: its round output stays apart from the request's


def _before_last_token(seq: Sequence) -> Sequence:
    """A decoding view of `seq` without its last token, sharing its block table: the first step of
    a round writes the KV of the token before the last; its max_tokens (one output token, one step)
    sends its later steps' K/V to the dummy block."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    view = Sequence(seq.request_id + CATCH_UP_SUFFIX, seq.token_ids[:-2], params)
    view.token_ids.append(seq.token_ids[-2])
    view.block_table = seq.block_table
    view.num_computed_tokens = seq.num_tokens - 2
    return view
