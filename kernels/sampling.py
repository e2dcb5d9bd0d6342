"""Greedy sampling: the argmax of each row of logits and its log-probability, in two small kernels
(or one, FUSED_MERGE).

torch needs an argmax, a logsumexp (max, subtract, exp, sum, log) and a gather: about ten kernels
per decode step over a [B, V] float32 copy of the logits. Here the first kernel reads the logits
once, in their own dtype, each program keeping an online (max, first index of the max, sum of
exp(x - max)) over a chunk of the vocabulary; the second (or the row's last chunk) merges the chunks
of a row. The logprob of the argmax is then -log(sum(exp(x - max))). Ties go to the lowest index, as
torch.argmax.

With a grammar's token bitmask ([B, ceil(V/32)] int32, bit j of word w allows token 32w + j), the
argmax is taken over the allowed tokens only, while the log-probability stays the model's own
(the log-sum-exp runs over every token), as the torch path of engine/sample/sampler.py does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel
from graphserve.kernels.bitmask import unpack_bitmask
from graphserve.kernels._split_counters import last_to_arrive, split_counters

_BLOCK = 1024
# Vocabulary entries a program of the first pass covers (a multiple of _BLOCK): one load deep, so a row
# spreads over more programs (149 for Qwen's vocabulary instead of 38 at 4096). At batch 64 it measured
# alike: Qwen2.5-0.5B 64,031 / 64,155 against 64,283 / 63,622 tok/s with 4096
# (8615439:benchmarks/results/decode_latency-h200-greedy-chunk-b64-ab-2026-12-03.json).
CHUNK = 1024
# The last chunk of a row to finish merges the row's partials (kernels/_split_counters.py) instead of a
# second kernel, and that one kernel launches with programmatic dependent launch (the step's record
# kernel after it starts during its tail). With CHUNK 1024, H200, interleaved (decode_latency.py
# --greedy-fused-merge, --greedy-chunk): Qwen2.5-0.5B batch 1 1,836 / 1,845 against 1,829 / 1,831 tok/s
# without; with PDL_EMBEDDING too 1,844-1,852 (8615439:benchmarks/results/decode_latency-h200-step-kernels-ab-2026-12-03.json).
FUSED_MERGE = True


@triton.jit
def _argmax_partial_kernel(
    logits_ptr, bitmask_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr, part_lse_max_ptr, counter_ptr,
    tokens_ptr, logprobs_ptr,
    stride_l, stride_m, vocab, num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """FUSED_MERGE: each program counts its chunk done on counter_ptr[row], and the row's last merges."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if PDL:
        wait_for_previous_kernel()
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # running max of all logits (log-sum-exp)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    am = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # running max of the allowed logits (argmax)
    idx = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + offs
        x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        # lanes still at -inf contribute nothing (and must not make exp(-inf - -inf) = NaN)
        s = tl.where(new_m == float("-inf"), 0.0, s * tl.exp(m - new_m) + tl.exp(x - new_m))
        m = new_m
        allowed = cols < vocab
        if MASKED:
            words = tl.load(bitmask_ptr + row * stride_m + cols // 32, mask=cols < vocab, other=0)
            allowed = allowed & (((words >> (cols % 32)) & 1) != 0)
        # strictly greater: a lane keeps its first maximum; an allowed -inf still names a token
        take = allowed & ((x > am) | (idx == 2147483647))
        idx = tl.where(take, cols, idx)
        am = tl.where(take, x, am)
    best = tl.max(am, 0)
    first = tl.min(tl.where((am == best) & (idx != 2147483647), idx, 2147483647), 0)
    lse_max = tl.max(m, 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - lse_max)), 0)
    out = row * num_chunks + chunk
    tl.store(part_max_ptr + out, best)
    tl.store(part_idx_ptr + out, first)
    tl.store(part_lse_max_ptr + out, lse_max)
    tl.store(part_sum_ptr + out, total)
    if FUSED_MERGE:
        if last_to_arrive(counter_ptr + row, num_chunks):
            _merge_row(logits_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr, part_lse_max_ptr, tokens_ptr,
                       logprobs_ptr, row, stride_l, num_chunks, CHUNKS_PAD, ".cg")


@triton.jit
def _argmax_merge_kernel(
    logits_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr, part_lse_max_ptr, tokens_ptr, logprobs_ptr,
    stride_l, num_chunks,
    CHUNKS_PAD: tl.constexpr,
):
    _merge_row(logits_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr, part_lse_max_ptr, tokens_ptr, logprobs_ptr,
               tl.program_id(0).to(tl.int64), stride_l, num_chunks, CHUNKS_PAD, "")


@triton.jit
def _merge_row(logits_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr, part_lse_max_ptr, tokens_ptr, logprobs_ptr,
               row, stride_l, num_chunks, CHUNKS_PAD: tl.constexpr, CACHE: tl.constexpr):
    """A row's token and logprob from its chunks' partials (CACHE ".cg": written by other programs of the
    same launch, read through L2)."""
    offs = tl.arange(0, CHUNKS_PAD)
    mask = offs < num_chunks
    am = tl.load(part_max_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"), cache_modifier=CACHE)
    idx = tl.load(part_idx_ptr + row * num_chunks + offs, mask=mask, other=2147483647, cache_modifier=CACHE)
    m = tl.load(part_lse_max_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"), cache_modifier=CACHE)
    s = tl.load(part_sum_ptr + row * num_chunks + offs, mask=mask, other=0.0, cache_modifier=CACHE)
    best = tl.max(am, 0)
    first = tl.min(tl.where((am == best) & (idx != 2147483647), idx, 2147483647), 0)
    first = tl.where(first == 2147483647, 0, first)  # nothing allowed (a mask bug): token 0, not garbage
    lse_max = tl.max(m, 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - lse_max)), 0)
    chosen = tl.load(logits_ptr + row * stride_l + first).to(tl.float32)
    tl.store(tokens_ptr + row, first.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - lse_max - tl.log(total))


def greedy_sample(logits: torch.Tensor, bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, last dim contiguous) -> (argmax [B] int64, its log-softmax
    value [B] float32). `bitmask` [B, ceil(V/32)] int32: the argmax over the allowed tokens only."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"expected logits [B, V] with a contiguous last dim, got {tuple(logits.shape)}")
    if bitmask is not None and (bitmask.shape != (logits.shape[0], triton.cdiv(logits.shape[1], 32))
                                or bitmask.dtype != torch.int32 or bitmask.stride(-1) != 1):
        raise ValueError(f"expected an int32 bitmask [B, ceil(V/32)], got {tuple(bitmask.shape)} {bitmask.dtype}")
    if CHUNK % _BLOCK:  # a program's loop steps a whole _BLOCK: a shorter chunk would overlap the next
        raise ValueError(f"graphserve.kernels.sampling.CHUNK must be a multiple of {_BLOCK}, got {CHUNK}")
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    dev = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return tokens, logprobs
    part_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    part_sum = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    part_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=dev)
    part_lse_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    counters = split_counters(dev, "greedy_sample", rows) if FUSED_MERGE else None
    pdl = FUSED_MERGE and use_pdl(dev, elementwise=True)
    chunks_pad = max(2, triton.next_power_of_2(num_chunks))
    _argmax_partial_kernel[(rows, num_chunks)](
        logits, bitmask if bitmask is not None else part_idx, part_max, part_idx, part_sum, part_lse_max,
        counters if counters is not None else part_idx, tokens, logprobs,
        logits.stride(0), bitmask.stride(0) if bitmask is not None else 0, vocab, num_chunks,
        CHUNK=CHUNK, BLOCK=_BLOCK, MASKED=bitmask is not None, FUSED_MERGE=counters is not None,
        CHUNKS_PAD=chunks_pad, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    if counters is None:
        _argmax_merge_kernel[(rows,)](
            logits, part_max, part_idx, part_sum, part_lse_max, tokens, logprobs, logits.stride(0), num_chunks,
            CHUNKS_PAD=chunks_pad, num_warps=1,
        )
    return tokens, logprobs


def greedy_sample_ref(logits: torch.Tensor, bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    allowed = logits
    if bitmask is not None:
        allowed = logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))
    tokens = allowed.argmax(dim=-1)
    return tokens, logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
