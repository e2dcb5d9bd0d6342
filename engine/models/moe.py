"""The routed-experts MLP of Qwen3-MoE and Mixtral: in plain torch on the CPU backend, through
kernels/moe.py's fused Triton path on CUDA (one GPU: moe_config.check_moe_servable, sharding).

Each token's router logits go through a float32 softmax; the top-k probabilities (torch.topk, so
ties break as in transformers) become its routing weights, renormalized to sum to 1 where the
model says so. Each expert is a SwiGLU MLP; it runs on the tokens routed to it only, and its
outputs, scaled by their routing weights, are added into the tokens' rows in ascending expert
order (transformers' order, so float32 sums match it bit for bit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.engine.models.activation import silu_and_mul
from graphserve.engine.models.layers import Linear
from graphserve.engine.models.moe_config import MoeArgs
from graphserve.kernels.moe import fused_moe, route  # route: one routing for both paths (ties alike)


class SparseMoE(nn.Module):
    """Parameters: router [E, H] (a Linear: packed for the CPU's decode-sized batches like every
    projection), gate_up_proj [E, 2I, H] (each expert's [gate; up]), down_proj [E, H, I]."""

    def __init__(self, hidden_size: int, moe: MoeArgs):
        super().__init__()
        self.moe = moe
        experts, inter = moe.num_experts, moe.expert_intermediate_size
        self.router = Linear(hidden_size, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden_size, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the normed hidden states [T, H]; returns the experts' weighted sum [T, H]."""
        if x.is_cuda:
            return fused_moe(x, self.router(x), self.gate_up_proj, self.down_proj, self.moe.top_k,
                             self.moe.renormalize)
        weights, experts = route(self.router(x), self.moe.top_k, self.moe.renormalize)
        return combine_experts(x, weights, experts, self.gate_up_proj, self.down_proj)


def combine_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor) -> torch.Tensor:
    """sum over each token's k picks of weight * down(silu(gate(x)) * up(x)), each expert run once
    over the tokens routed to it (none: skipped)."""
    top_k = experts.shape[1]
    picks = experts.flatten()  # [T * k]: token t's picks at t * k ... t * k + k - 1
    order = picks.argsort(stable=True)  # picks grouped by expert, ascending
    counts = torch.bincount(picks, minlength=gate_up_proj.shape[0]).tolist()  # the host needs them to slice
    sorted_weights = weights.flatten()[order].to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        span = slice(start, start + count)
        start += count
        tokens = order[span] // top_k
        hidden = silu_and_mul(F.linear(x.index_select(0, tokens), gate_up_proj[expert]))
        out.index_add_(0, tokens, F.linear(hidden, down_proj[expert]) * sorted_weights[span, None])
    return out
