"""A mixture-of-experts layer's routing in one Triton program per token: the float32 softmax of the
router logits, the top k (ties to the lowest expert id, as torch.topk breaks them), and the
renormalization where the model asks for it. kernels/moe.route (softmax, torch.topk, a division) is
its reference; on a GPU at one token those are six kernels and about 15 us of a Qwen3-30B-A3B layer's
61 (benchmarks/moe_kernel_bench.py --kernels), this one is one.

The top k come from k passes of an argmax over the row held in registers (the largest remaining
probability, the lowest id among equals), so a row of up to MAX_EXPERTS experts fits one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel

MAX_EXPERTS = 1024  # a row in one program's registers; past it, kernels/moe.route


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    if PDL:  # the logits are the kernel before's
        wait_for_previous_kernel()
    logits = tl.load(logits_ptr + token * stride_t + offs, mask=valid, other=float("-inf")).to(tl.float32)
    exps = tl.where(valid, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    remaining = tl.where(valid, exps / tl.sum(exps, axis=0), -1.0)  # taken and padding: below any probability
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        expert = tl.min(tl.where(remaining == best, offs, BLOCK_E), axis=0)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, expert.to(tl.int64), ids)
        remaining = tl.where(offs == expert, -1.0, remaining)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # slots past TOP_K hold 0
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)


def route_fused(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/moe.route in one kernel: (routing weights [T, k] float32, expert ids [T, k] int64)."""
    tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"top {top_k} of {num_experts} experts: route_fused takes 1 <= k <= E <= {MAX_EXPERTS}")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        pdl = use_pdl(router_logits.device, elementwise=True)
        _route_kernel[(tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0),
                                 TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
                                 BLOCK_K=triton.next_power_of_2(top_k), PDL=pdl,
                                 num_warps=4 if num_experts > 256 else 1, launch_pdl=pdl)
    return weights, ids
