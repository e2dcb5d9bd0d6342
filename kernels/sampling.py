"""Greedy sampling: the argmax of each row of logits and its log-probability, in two small kernels.

torch needs an argmax, a logsumexp (max, subtract, exp, sum, log) and a gather: about ten kernels
per decode step over a [B, V] float32 copy of the logits. Here the first kernel reads the logits
once, in their own dtype, each program keeping an online (max, first index of the max, sum of
exp(x - max)) over a chunk of the vocabulary; the second merges the chunks of a row. The logprob
of the argmax is then -log(sum(exp(x - max))). Ties go to the lowest index, as torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 4096  # vocabulary entries per program of the first pass
_BLOCK = 1024


@triton.jit
def _argmax_partial_kernel(
    logits_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr,
    stride_l, vocab, num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    idx = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + offs
        x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        # lanes still at -inf contribute nothing (and must not make exp(-inf - -inf) = NaN)
        s = tl.where(new_m == float("-inf"), 0.0, s * tl.exp(m - new_m) + tl.exp(x - new_m))
        idx = tl.where(x > m, cols, idx)  # strictly greater: a lane keeps its first maximum
        m = new_m
    best = tl.max(m, 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - best)), 0)
    first = tl.min(tl.where(m == best, idx, 2147483647), 0)
    out = row * num_chunks + chunk
    tl.store(part_max_ptr + out, best)
    tl.store(part_sum_ptr + out, total)
    tl.store(part_idx_ptr + out, first)


@triton.jit
def _argmax_merge_kernel(
    part_max_ptr, part_idx_ptr, part_sum_ptr, tokens_ptr, logprobs_ptr,
    num_chunks,
    CHUNKS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS_PAD)
    mask = offs < num_chunks
    m = tl.load(part_max_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    s = tl.load(part_sum_ptr + row * num_chunks + offs, mask=mask, other=0.0)
    idx = tl.load(part_idx_ptr + row * num_chunks + offs, mask=mask, other=2147483647)
    best = tl.max(m, 0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - best)), 0)
    first = tl.min(tl.where(m == best, idx, 2147483647), 0)
    tl.store(tokens_ptr + row, first.to(tl.int64))
    tl.store(logprobs_ptr + row, -tl.log(total))


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, last dim contiguous) -> (argmax [B] int64, its log-softmax
    value [B] float32)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"expected logits [B, V] with a contiguous last dim, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, _CHUNK)
    dev = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows == 0:
        return tokens, logprobs
    part_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    part_sum = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    part_idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=dev)
    _argmax_partial_kernel[(rows, num_chunks)](
        logits, part_max, part_idx, part_sum, logits.stride(0), vocab, num_chunks,
        CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=4,
    )
    _argmax_merge_kernel[(rows,)](
        part_max, part_idx, part_sum, tokens, logprobs, num_chunks,
        CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)), num_warps=1,
    )
    return tokens, logprobs


def greedy_sample_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    return tokens, logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
