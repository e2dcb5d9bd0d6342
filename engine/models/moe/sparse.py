"""The routed-experts MLP of Qwen3-MoE and Mixtral: in plain torch on the CPU backend, through
kernels/moe.py's fused Triton path on CUDA (one GPU: moe_config.check_moe_servable, sharding).

Each token's router logits go through a float32 softmax; the top-k probabilities (torch.topk, so
ties break as in transformers) become its routing weights, renormalized to sum to 1 where the
model says so. Each expert is a SwiGLU MLP; it runs on the tokens routed to it only, and its
outputs, scaled by their routing weights, are added into the tokens' rows in ascending expert
order (transformers' order, so float32 sums match it bit for bit).

With FP8 experts (to_fp8: `--quantization fp8`, or a pre-quantized checkpoint) each expert's
gate_up and down are float8 e4m3 with a float32 scale per output channel, as engine/models/fp8.py
quantizes a dense projection; the router stays in the model's dtype (its logits pick the experts,
and it is tiny). CUDA runs them weight-only in the fused kernel; the CPU path dequantizes each
chosen expert's weights and runs the same torch code, as the dense FP8 projection does on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.engine.models.activation import silu_and_mul
from graphserve.engine.models.fp8 import FP8, dequantize, quantize_experts
from graphserve.engine.models.hf_config.moe import MoeArgs
from graphserve.engine.models.layers import Linear
from graphserve.kernels.moe import fused_moe, route  # route: one routing for both paths (ties alike)


class SparseMoE(nn.Module):
    """Parameters: router [E, H] (a Linear: packed for the CPU's decode-sized batches like every
    projection), gate_up_proj [E, 2I, H] (each expert's [gate; up]), down_proj [E, H, I]; once FP8,
    gate_up_scale [E, 2I] and down_scale [E, H] too (None before)."""

    def __init__(self, hidden_size: int, moe: MoeArgs):
        super().__init__()
        self.moe = moe
        experts, inter = moe.num_experts, moe.expert_intermediate_size
        self.router = Linear(hidden_size, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden_size, inter))
        self.register_parameter("gate_up_scale", None)
        self.register_parameter("down_scale", None)

    def to_fp8(self, quantize: bool = True) -> None:
        """The experts' weights in float8 e4m3 with a float32 scale per expert and output channel:
        quantized from the current weights, or (quantize=False) empty, for a pre-quantized
        checkpoint to fill. The router is left as it is."""
        for name in ("gate_up", "down"):
            weight = getattr(self, f"{name}_proj").data
            if quantize:
                q, scale = quantize_experts(weight)
            else:
                q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
                scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            setattr(self, f"{name}_proj", nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the normed hidden states [T, H]; returns the experts' weighted sum [T, H]."""
        if x.is_cuda:
            return fused_moe(x, self.router(x), self.gate_up_proj, self.down_proj, self.moe.top_k,
                             self.moe.renormalize, gate_up_scale=self.gate_up_scale, down_scale=self.down_scale)
        weights, experts = route(self.router(x), self.moe.top_k, self.moe.renormalize)
        return combine_experts(x, weights, experts, self.gate_up_proj, self.down_proj, self.gate_up_scale,
                               self.down_scale)


def combine_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum over each token's k picks of weight * down(silu(gate(x)) * up(x)), each expert run once
    over the tokens routed to it (none: skipped). FP8 experts (with their scales): each chosen
    expert's weights dequantized to x's dtype first."""
    out = torch.zeros_like(x)
    for expert, tokens, expert_weights in tokens_by_expert(experts, weights, gate_up_proj.shape[0]):
        gate_up, down = gate_up_proj[expert], down_proj[expert]
        if gate_up_scale is not None:
            gate_up = dequantize(gate_up, gate_up_scale[expert], x.dtype)
            down = dequantize(down, down_scale[expert], x.dtype)
        hidden = silu_and_mul(F.linear(x.index_select(0, tokens), gate_up))
        out.index_add_(0, tokens, F.linear(hidden, down) * expert_weights.to(x.dtype)[:, None])
    return out


def tokens_by_expert(experts: torch.Tensor, weights: torch.Tensor,
                     num_experts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Each expert some token picked, in ascending order, with the rows of those tokens and the
    weights of their picks (experts, weights: [T, k]; a token's picks are distinct)."""
    top_k = experts.shape[1]
    picks = experts.flatten()  # [T * k]: token t's picks at t * k ... t * k + k - 1
    order = picks.argsort(stable=True)  # picks grouped by expert, ascending
    counts = torch.bincount(picks, minlength=num_experts).tolist()  # the host needs them to slice
    sorted_weights = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count:
            span = slice(start, start + count)
            yield expert, order[span] // top_k, sorted_weights[span]
        start += count
