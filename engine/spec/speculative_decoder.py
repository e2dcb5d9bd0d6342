"""A speculative round: the drafter's proposals, their KV slots, one verify pass, the accepted tokens.

When EngineConfig.speculative_method is set, a decode round's eligible sequences that have drafts
become a verify step (the others run the round as before): per sequence, the drafter proposes up
to k tokens, their KV slots are reserved, ModelRunner.verify scores the last token and the drafts
in one eager forward pass, verify_drafts accepts the leading drafts that equal what the sampler
would have drawn, and the accepted drafts plus the token after them (the correction, or a bonus
when every draft was accepted) go back to the engine core, which appends them as it appends a
round's tokens (EOS, stop token ids, max_tokens). The slots of rejected drafts are given back here.

Eligible: what verify_drafts reproduces exactly, temperature only. Greedy, or temperature > 0 with
no top-k / top-p / min-p filter; no penalties, logit bias, logprobs or grammar, and no min_tokens
still to wait for. A seeded sampled row gets the same tokens as without speculation: each
position's token is drawn with the sampler's (seed, output position) noise.

Where the verify step runs: with the decode graphs (CUDA), as one decode step of B * (k + 1) rows
(GraphDecoder.verify_logits: each position scored by the decode step's own forward pass);
without them (the CPU backend, enforce_eager), as ModelRunner.verify's eager pass over the paged KV.
A verify step ends with the host reading its tokens (the next drafts continue them), so a round
that speculates is not launched ahead (EngineCore._launches_ahead): with speculation on, rounds of more
than `max_batch` sequences (EngineConfig.speculative_max_batch) do not speculate and keep overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphserve.engine.request import Sequence
from graphserve.engine.runner.cuda_graphs import GraphDecoder
from graphserve.engine.runner.model_runner import ModelRunner, StepTokens
from graphserve.engine.sample.rejection_sampler import accept_greedy, greedy_targets, verify_drafts
from graphserve.engine.sample.sampler import build_sampling_tensors
from graphserve.engine.sched.kv_groups import KVGroups
from graphserve.engine.sched.scheduler import DecodeRound
from graphserve.engine.spec.drafter import Drafter, pack_drafts


def is_eligible(seq: Sequence, vocab_size: int) -> bool:
    """Whether verify_drafts gives `seq` the tokens the sampler would: temperature is the only
    control it applies."""
    p = seq.params
    return not (p.filters_top(vocab_size) or p.needs_penalties or p.logit_bias or p.logprobs is not None
                or p.grammar is not None or seq.num_output_tokens < p.min_tokens)


@dataclass
class DraftPlan:
    """A decode round split in two: sequences to verify with their drafts (KV slots reserved), and
    the rest, which run the round's K decode steps."""

    verify_seqs: list[Sequence]
    drafts: list[list[int]]  # placeholders of the right lengths when device_tokens holds them
    decode_seqs: list[Sequence]
    device_tokens: torch.Tensor | None = None  # [len(verify_seqs), k] on the device, not waited for


@dataclass
class VerifyStep:
    tokens: dict[str, StepTokens]  # per verified sequence: its accepted drafts, then the token after them
    num_draft_tokens: int
    num_accepted_tokens: int


class SpeculativeDecoder:
    """The drafter's view of the running sequences and the verify step."""

    def __init__(self, drafter: Drafter, num_speculative_tokens: int, runner: ModelRunner,
                 block_manager: KVGroups, max_model_len: int, max_batch: int | None = None):
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.max_batch = max_batch  # rounds of more sequences do not speculate (None: any)
        self.runner = runner
        self.blocks = block_manager
        self.max_model_len = max_model_len
        # request id -> how many of its tokens the drafter has seen. Tokens reach a sequence by
        # several paths (prefill, a decode riding along a prefill step, rounds, verify steps), so the
        # drafter catches up from seq.token_ids before each proposal. A preempted sequence keeps its
        # tokens, so its index stays valid across the recompute.
        self._seen: dict[str, int] = {}

    def applies(self, num_seqs: int) -> bool:
        """Whether a decode round of this many sequences speculates (else it decodes as without)."""
        return self.max_batch is None or num_seqs <= self.max_batch

    def plan(self, seqs: list[Sequence], max_verify: int | None = None, on_device: bool = False) -> DraftPlan:
        """Propose drafts for the eligible sequences (the first `max_verify` of them, when given) and
        reserve their KV slots. A sequence without drafts (not eligible or not among them, none
        proposed, one token left, the pool short of blocks) decodes as usual. on_device: the verify
        step runs through the decode graphs, which take drafts left on the device (the drafter's
        propose_on_device, when it has them there); the plan's drafts are then placeholders of the
        right lengths, and device_tokens the tokens."""
        vocab = self.runner.vocab_size
        candidates = [s for s in seqs if is_eligible(s, vocab)][:max_verify]
        for seq in candidates:
            self._catch_up(seq)
        # the drafts and the token after them stay within max_tokens, and so within max_model_len
        # (engine/inputs.py fitted max_tokens to it)
        limits = [max(0, min(self.k, s.num_tokens_left - 1)) for s in candidates]
        ids = [s.request_id for s in candidates]
        on_device = self.drafter.propose_on_device(ids, limits) if on_device and candidates else None
        proposals = self.drafter.propose(ids, limits) if on_device is None else [[0] * n for n in on_device.counts]
        plan = DraftPlan([], [], [])
        rows = []  # of the kept ones, in on_device.tokens
        for i, (seq, proposal) in enumerate(zip(candidates, proposals)):
            if proposal and self.blocks.reserve_draft_slots(seq, len(proposal)):
                plan.verify_seqs.append(seq)
                plan.drafts.append(proposal)
                rows.append(i if on_device is None else on_device.rows[i])
        drafted = {s.request_id for s in plan.verify_seqs}
        plan.decode_seqs = [s for s in seqs if s.request_id not in drafted]
        if on_device is not None and rows:  # a pinned index, so as not to wait for the drafts in flight
            tokens = on_device.tokens
            index = torch.tensor(rows, pin_memory=tokens.is_cuda).to(tokens.device, non_blocking=True)
            plan.device_tokens = tokens.index_select(0, index)
        return plan

    def run_round(self, rnd: DecodeRound, graphs: GraphDecoder | None,
                  decode: Callable[[DecodeRound], dict[str, StepTokens]]) -> tuple[dict[str, StepTokens],
                                                                                   VerifyStep | None]:
        """A decode round with speculation on: the sequences with drafts run one verify step (up to
        k + 1 tokens each), the others the round's K decode steps (`decode`). Returns the tokens of
        both, and the verify step (None when no sequence had drafts)."""
        plan = self.plan(rnd.seqs, self.max_verify(graphs), on_device=graphs is not None)
        tokens = decode(DecodeRound(plan.decode_seqs, rnd.num_steps)) if plan.decode_seqs else {}
        if not plan.verify_seqs:
            return tokens, None
        verified = self.verify(plan.verify_seqs, plan.drafts, graphs, plan.device_tokens)
        tokens.update(verified.tokens)
        return tokens, verified

    def max_verify(self, graphs: GraphDecoder | None) -> int | None:
        """The most sequences one verify step takes: what the largest decode graph holds."""
        return None if graphs is None else graphs.max_bucket // (self.k + 1)

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], drafts: list[list[int]], graphs: GraphDecoder | None = None,
               device_tokens: torch.Tensor | None = None) -> VerifyStep:
        """One verify pass over `seqs` and their drafts, through the decode graphs when given (which
        read the drafts from device_tokens when given: DraftPlan); gives back the slots of rejected
        drafts. Changes no token list: the caller appends the returned tokens."""
        runner = self.runner
        if graphs is not None:
            logits = graphs.verify_logits(seqs, drafts, self.k, device_tokens)  # [B, k + 1, V]
        else:
            logits = runner.verify(seqs, drafts, self.k)
        if all(s.params.greedy for s in seqs):
            targets = greedy_targets(logits, device_tokens)  # with the drafts: one read for both
            if device_tokens is not None:
                drafts = [row[self.k + 1:self.k + 1 + len(d)] for row, d in zip(targets, drafts)]
            num_accepted, token_ids = accept_greedy(targets, drafts)
        else:
            if device_tokens is not None:
                draft_ids = device_tokens
                num_drafts = torch.tensor(list(map(len, drafts)), dtype=torch.int64).to(runner.device)
            else:
                draft_ids, num_drafts = pack_drafts(drafts, self.k, runner.device)
            # the sampler's temperature, seeds and output positions of each row's first token
            st = build_sampling_tensors(seqs, runner.vocab_size, runner.eos_ids, runner.device)
            out = verify_drafts(logits, draft_ids, num_drafts, st.temperature, st.seeds, st.output_pos)
            num_accepted = out.num_accepted.tolist()
            token_ids = out.token_ids.tolist()
        tokens = {}
        for seq, n, row in zip(seqs, num_accepted, token_ids):
            tokens[seq.request_id] = StepTokens(row[:n + 1])
            # KV is kept for the last token and the n accepted drafts (as BlockManager.roll_back_drafts
            # leaves it once the n + 1 tokens are appended); blocks holding only rejected slots go back
            self.blocks.trim(seq, seq.num_tokens + n)
        return VerifyStep(tokens, sum(map(len, drafts)), sum(num_accepted))

    @property
    def num_tracked_requests(self) -> int:
        """Requests the drafter holds state for (0 once every request has ended)."""
        return len(self._seen)

    def release(self, request_id: str) -> None:
        """The request ended: drop the drafter's state of it."""
        if self._seen.pop(request_id, None) is not None:
            self.drafter.on_finish(request_id)

    def _catch_up(self, seq: Sequence) -> None:
        seen = self._seen.get(seq.request_id)
        if seen is None:
            self.drafter.add_request(seq.request_id, seq.token_ids)
        elif seen < seq.num_tokens:
            self.drafter.on_append(seq.request_id, seq.token_ids[seen:])
        self._seen[seq.request_id] = seq.num_tokens
