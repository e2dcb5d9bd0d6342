"""The rejection sampler of speculative decoding: which drafts the target accepts, and the token after them.

Batched over rows, static shapes, no host sync: it is meant to run inside a captured CUDA graph.
Position j of a row scores the token at output position output_pos + j, given the row's drafts
before j. For each row it returns the number of accepted drafts n and k + 1 tokens: the n drafts,
then one more token (the correction at the first rejection, or the bonus token after the last
draft), then PAD_TOKEN_ID.

- Greedy rows (temperature 0): accept while the draft is the argmax; the extra token is the argmax.
  The tokens are those of plain greedy decoding. A batch of greedy rows alone takes the short way
  (greedy_targets, accept_greedy): the argmax of every position in one pass, compared on the host,
  the same rule without the sampled rows' dozens of kernels.
- Sampled rows, no draft probabilities (a deterministic drafter such as n-gram, q one-hot on the
  draft): the target token of each position is drawn exactly as engine/sample/sampler.py draws it
  (Gumbel-max with noise hashed from (seed, output position, vocab id)), and drafts are accepted
  while they equal it. This is rejection sampling for a one-hot q (accept with probability p(d);
  otherwise a draw from p without d), and the tokens are those the seeded request gets without
  speculation.
- Sampled rows with draft probabilities q: standard rejection sampling. Accept draft d with
  probability min(1, p(d) / q(d)); at the first rejection draw from max(0, p - q), normalised;
  after the last draft draw from p. Its random numbers come from streams of their own, not the
  sampler's: a draft model that samples d with the request's seed through the sampler would
  otherwise correlate d with the correction and bias it (a test shows the bias).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphserve.engine.sample.hash_random import hash_uniform

PAD_TOKEN_ID = -1  # the tokens after a row's extra token

# Independent noise streams of one (seed, position). SAMPLER_STREAM is engine/sample/sampler.py's own.
SAMPLER_STREAM = 0
_COIN_STREAM = 1  # rejection sampling's accept/reject coin
_RESIDUAL_STREAM = 2  # rejection sampling's correction and bonus draws


@dataclass
class VerifyOutput:
    num_accepted: torch.Tensor  # [B] int64, 0..num_drafts
    token_ids: torch.Tensor  # [B, k + 1] int64: accepted drafts, the extra token, then PAD_TOKEN_ID


def _gumbel_argmax(log_weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                   stream: int) -> torch.Tensor:
    """argmax(log w + Gumbel noise) over the last dim: a draw from w / sum(w). [B, P, V] -> [B, P]."""
    gumbel = -torch.log(-torch.log(hash_uniform(seeds, positions, log_weights.shape[-1], stream)))
    return (log_weights + gumbel).argmax(dim=-1)


def accept_drafts(p_draft: torch.Tensor, q_draft: torch.Tensor, coin: torch.Tensor) -> torch.Tensor:
    """Rejection sampling's test, accept with probability min(1, p/q): coin < p / q, written
    without the division so that q = 0 (a draft q never proposes) cannot make a NaN."""
    return coin * q_draft < p_draft


def residual_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised: what a rejection is drawn from. Where rounding leaves it all zero
    (p == q, so a rejection had probability ~0) it falls back to p."""
    residual = (p - q).clamp_min(0)
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)


def verify_drafts(logits: torch.Tensor, draft_token_ids: torch.Tensor, num_drafts: torch.Tensor,
                  temperature: torch.Tensor, seeds: torch.Tensor, output_pos: torch.Tensor,
                  draft_probs: torch.Tensor | None = None) -> VerifyOutput:
    """Accept or reject each row's drafts.

    logits: [B, k + 1, V] target logits, after any logit processors and top-k/p filters.
    draft_token_ids: [B, k] int64; entries at or after num_drafts are ignored (any value).
    num_drafts: [B] int64 in 0..k. temperature: [B] float32, 0 = greedy.
    seeds: [B] int64 (32-bit values) and output_pos: [B] int64, the output index of position 0's
    token, as in the sampler's SamplingTensors.
    draft_probs: [B, k, V] the distribution q each draft was drawn from (after the drafter's own
    temperature and filters), or None for a deterministic drafter (q one-hot on the draft).
    """
    _, width, vocab = logits.shape
    k = width - 1
    device = logits.device
    steps = torch.arange(width, device=device)
    positions = output_pos[:, None] + steps[None, :]  # [B, k + 1]
    valid = steps[None, :k] < num_drafts[:, None]  # [B, k]
    drafts = draft_token_ids.clamp(0, vocab - 1)  # memory safety for the gathers; padding is never accepted
    greedy = (temperature <= 0)[:, None]

    logits = logits.float()
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temp[:, None, None]  # the same float ops as the sampler, for identical draws
    target = torch.where(greedy, logits.argmax(dim=-1), _gumbel_argmax(scaled, seeds, positions, SAMPLER_STREAM))

    accepted = valid & (drafts == target[:, :k])
    extra = target
    if draft_probs is not None:
        p, q = scaled.softmax(dim=-1), draft_probs.float()
        coin = hash_uniform(seeds, positions[:, :k], 1, _COIN_STREAM)[..., 0]
        p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_draft = q.gather(-1, drafts[..., None])[..., 0]
        # after the last draft (j = num_drafts) the bonus is drawn from p itself
        weights = torch.cat([residual_weights(p[:, :k], q), p[:, k:]], dim=1)
        weights = torch.where(steps[None, :, None] < num_drafts[:, None, None], weights, p)
        drawn = _gumbel_argmax(weights.log(), seeds, positions, _RESIDUAL_STREAM)
        accepted = torch.where(greedy, accepted, valid & accept_drafts(p_draft, q_draft, coin))
        extra = torch.where(greedy, target, drawn)

    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # the leading run of acceptances
    drafts_padded = torch.cat([drafts, target[:, k:]], dim=1)  # [B, k + 1]; the last column is never read
    n = num_accepted[:, None]
    token_ids = torch.where(steps[None, :] < n, drafts_padded,
                            torch.where(steps[None, :] == n, extra, torch.full_like(extra, PAD_TOKEN_ID)))
    return VerifyOutput(num_accepted=num_accepted, token_ids=token_ids)


def greedy_targets(logits: torch.Tensor, also: torch.Tensor | None = None) -> list[list[int]]:
    """The argmax of each position of logits [B, k + 1, V] (ties to the lowest id, as the sampler's),
    on the host: on CUDA the sampler's greedy kernel, one pass over the logits in their own dtype.
    `also` [B, n] (a device's drafts): each row's targets come followed by its row of it, in one read."""
    b, width, vocab = logits.shape
    flat = logits.reshape(b * width, vocab)
    if flat.is_cuda:
        from graphserve.kernels.sampling import greedy_sample

        ids = greedy_sample(flat)[0]
    else:
        ids = flat.argmax(dim=-1)
    ids = ids.view(b, width)
    return (ids if also is None else torch.cat([ids, also.to(ids.dtype)], dim=1)).tolist()


def accept_greedy(targets: list[list[int]], drafts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Greedy acceptance on the host: per row, the number n of leading drafts equal to the target
    there, and the tokens that follow (the n drafts, then the target after them)."""
    num_accepted, tokens = [], []
    for row, proposal in zip(targets, drafts):
        n = next((j for j, d in enumerate(proposal) if d != row[j]), len(proposal))
        num_accepted.append(n)
        tokens.append(row[:n + 1])
    return num_accepted, tokens
