"""The sampler: per-row logit processors (bias, penalties, min_tokens, grammar masks), filters and draws.

Batched on the device with no host sync.
Every control is a per-row tensor, so one code path serves a mixed batch and stays
capturable in a CUDA graph. Random numbers come from a hash of (seed, output position,
vocab id): a request's draws do not depend on what else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphserve.engine.request import Sequence
from graphserve.engine.sample.hash_random import hash_uniform
from graphserve.kernels.bitmask import unpack_bitmask

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; vocab size when disabled
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64 (32-bit values)
    output_pos: torch.Tensor  # [B] int64: index in the output of the token being sampled
    # optional processors: None unless a row in the batch uses them (decided when the batch is built)
    logit_bias: torch.Tensor | None = None  # [B, V] float32
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, V] float32 counts of generated tokens
    prompt_mask: torch.Tensor | None = None  # [B, V] bool: token occurs in the prompt
    min_tokens: torch.Tensor | None = None  # [B] int64
    min_tokens_ban: torch.Tensor | None = None  # [B, V] bool: EOS / stop ids banned before min_tokens
    token_bitmask: torch.Tensor | None = None  # [B, ceil(V/32)] int32: what a grammar allows (structured.py)
    all_greedy: bool = False
    use_top_filters: bool = False
    num_logprobs: int = 0  # top-N alternatives to return (max over rows)

    @property
    def has_processors(self) -> bool:
        """Logit processors other than a grammar's bitmask (which the greedy kernel applies itself)."""
        return self.logit_bias is not None or self.output_counts is not None or self.min_tokens_ban is not None


def build_sampling_tensors(seqs: list[Sequence], vocab_size: int, eos_ids: tuple[int, ...],
                           device: torch.device, pending: list[int] | None = None,
                           token_bitmask: torch.Tensor | None = None) -> SamplingTensors:
    """Per-row tensors for `seqs`, built on the host once per round. `token_bitmask`: the
    grammar masks of the rows (StructuredOutputs.bitmask), or None. `pending`: per sequence,
    tokens it generated on the device that are not appended yet; they shift the output
    position (and with it the sampling noise and min_tokens). The penalties count the
    appended tokens only, so they cannot be combined with pending ones."""
    params = [s.params for s in seqs]
    b = len(seqs)
    pending = pending or [0] * b
    if any(pending) and any(p.needs_penalties for p in params):
        raise ValueError("penalties need every generated token on the host (pending must be 0)")

    def col(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    st = SamplingTensors(
        temperature=col([p.temperature for p in params], torch.float32),
        top_k=col([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64),
        top_p=col([p.top_p for p in params], torch.float32),
        min_p=col([p.min_p for p in params], torch.float32),
        seeds=col([s.seed & _MASK32 for s in seqs], torch.int64),
        output_pos=col([s.num_output_tokens + ahead for s, ahead in zip(seqs, pending)], torch.int64),
        all_greedy=all(p.greedy for p in params),
        use_top_filters=any(p.filters_top(vocab_size) for p in params),
        num_logprobs=max([p.logprobs or 0 for p in params], default=0),
    )
    if token_bitmask is not None:
        st.token_bitmask = token_bitmask.to(device, non_blocking=device.type == "cuda")
    if any(p.logit_bias for p in params):
        bias = torch.zeros(b, vocab_size)
        for i, p in enumerate(params):
            for token, value in p.logit_bias.items():
                if 0 <= token < vocab_size:
                    bias[i, token] = value
        st.logit_bias = bias.to(device)
    if any(p.needs_penalties for p in params):
        counts = torch.zeros(b, vocab_size)
        prompt_mask = torch.zeros(b, vocab_size, dtype=torch.bool)
        for i, s in enumerate(seqs):
            out = s.output_token_ids
            if out:
                counts[i].index_add_(0, torch.tensor(out), torch.ones(len(out)))
            prompt_mask[i, torch.tensor(s.prompt_token_ids)] = True
        st.output_counts, st.prompt_mask = counts.to(device), prompt_mask.to(device)
        st.presence_penalty = col([p.presence_penalty for p in params], torch.float32)
        st.frequency_penalty = col([p.frequency_penalty for p in params], torch.float32)
        st.repetition_penalty = col([p.repetition_penalty for p in params], torch.float32)
    if any(p.min_tokens > 0 for p in params):
        ban = torch.zeros(b, vocab_size, dtype=torch.bool)
        for i, p in enumerate(params):
            stops = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos_ids)) if 0 <= t < vocab_size]
            if p.min_tokens > 0 and stops:
                ban[i, stops] = True
        st.min_tokens = col([p.min_tokens for p in params], torch.int64)
        st.min_tokens_ban = ban.to(device)
    return st


def apply_processors(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Logit bias, penalties and min_tokens, applied to a copy of the float32 logits."""
    if st.logit_bias is not None:
        logits = logits + st.logit_bias
    if st.output_counts is not None:
        seen = st.prompt_mask | (st.output_counts > 0)
        rep = st.repetition_penalty[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - st.frequency_penalty[:, None] * st.output_counts
        logits = logits - st.presence_penalty[:, None] * (st.output_counts > 0).float()
    if st.token_bitmask is not None:  # a grammar's mask is absolute
        logits = logits.masked_fill(~unpack_bitmask(st.token_bitmask, logits.shape[-1]), float("-inf"))
    if st.min_tokens_ban is not None:
        banned = st.min_tokens_ban & (st.output_pos < st.min_tokens)[:, None]
        held = logits.masked_fill(banned, float("-inf"))
        if st.token_bitmask is not None:  # min_tokens yields to a grammar that allows only its end
            held = torch.where(torch.isinf(held).all(dim=-1, keepdim=True), logits, held)
        logits = held
    return logits


def _top_filters(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask everything outside top-k, top-p (nucleus) and min-p, per row."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    probs = sorted_logits.softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs
    drop = (rank >= st.top_k[:, None]) | (cum_before > st.top_p[:, None])
    drop |= probs < st.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: log-probability of the chosen token under the model
    top_ids: torch.Tensor | None = None  # [B, N]
    top_logprobs: torch.Tensor | None = None  # [B, N]


def sample(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    """logits: [B, V] raw model logits (float32 or the model's dtype). Returns the next tokens and
    their logprobs (computed in float32)."""
    if logits.is_cuda and st.all_greedy and st.num_logprobs == 0 and not st.has_processors:
        from graphserve.kernels.sampling import greedy_sample

        return SamplerOutput(*greedy_sample(logits, st.token_bitmask))  # two kernels instead of about ten
    logits = logits.float()
    processed = apply_processors(logits, st)
    greedy_tokens = processed.argmax(dim=-1)
    if st.all_greedy:
        tokens = greedy_tokens
    else:
        temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
        scaled = processed / temp[:, None]
        if st.use_top_filters:
            scaled = _top_filters(scaled, st)
        # Gumbel-max: argmax(logits/T + Gumbel noise) draws from softmax(logits/T)
        gumbel = -torch.log(-torch.log(hash_uniform(st.seeds, st.output_pos, logits.shape[-1])))
        sampled = (scaled + gumbel).argmax(dim=-1)
        tokens = torch.where(st.temperature > 0, sampled, greedy_tokens)
    if st.num_logprobs > 0:
        raw_logprobs = logits.log_softmax(dim=-1)
        out = SamplerOutput(tokens=tokens, logprobs=raw_logprobs.gather(1, tokens[:, None]).squeeze(1))
        out.top_logprobs, out.top_ids = raw_logprobs.topk(st.num_logprobs, dim=-1)
        return out
    # the chosen token's logprob without materialising a [B, V] log_softmax
    chosen = logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(dim=-1)
    return SamplerOutput(tokens=tokens, logprobs=chosen)


def count_output_tokens(st: SamplingTensors, tokens: torch.Tensor) -> None:
    """Count a step's sampled `tokens` for the penalties, where asked (in place, on the device; the
    output position advances with the step's record, kernels/step_bookkeeping.py)."""
    if st.output_counts is not None:
        st.output_counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.float32))
