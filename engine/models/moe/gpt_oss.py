"""gpt-oss's MLP: a router with a bias, and experts with biases and a clamped SwiGLU, their weights bf16 or
MXFP4 as the checkpoint stores them.

Routing (transformers' GptOssTopKRouter): the top k router logits, softmaxed among themselves. On the CPU
it runs so, in torch; on CUDA kernels/moe_route.route_fused takes the top k of the softmax over all logits
renormalized over the k, the same weights up to rounding. Each expert (GptOssExperts) is
act(x @ gate_up + b) @ down + c with act(gate, up) = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g),
g = min(gate, limit); its output times its routing weight is added into the token's row, experts in
ascending order, as transformers does.

Weights, in our layout (loading/gpt_oss_weights.py converts a checkpoint's): gate_up [E, 2I, H] (each expert's gate
rows, then its up rows), down [E, H, I], biases gate_up_bias [E, 2I] and down_bias [E, H]. MXFP4
(use_mxfp4): gate_up_blocks uint8 [E, 2I, H / 2] and gate_up_scales [E, 2I, H / 32], down_blocks
[E, H, I / 2] and down_scales [E, H, I / 32] (kernels/mxfp4.py), which CUDA serves as stored
(kernels/gpt_oss_experts.py) and the CPU backend dequantizes once, at load (dequantize_experts), into
the float weights its torch path reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.engine.models import layers
from graphserve.engine.models.hf_config.gpt_oss import GptOssArgs
from graphserve.engine.models.hf_config.moe import MoeArgs
from graphserve.engine.models.layers import Linear
from graphserve.engine.models.moe.sparse import tokens_by_expert
from graphserve.kernels.gpt_oss_experts import clamped_swiglu, gpt_oss_experts
from graphserve.kernels.moe_route import route_fused
from graphserve.kernels.mxfp4 import GROUP, dequantize

_MXFP4 = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")


class GptOssMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeArgs, args: GptOssArgs, mxfp4: bool):
        super().__init__()
        self.moe, self.alpha, self.limit = moe, args.swiglu_alpha, args.swiglu_limit
        experts, inter = moe.num_experts, moe.expert_intermediate_size
        self.router = Linear(hidden_size, experts, bias=True)
        self.gate_up_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_bias = nn.Parameter(torch.empty(experts, hidden_size))
        self.mxfp4 = mxfp4
        if mxfp4:  # (sizes in whole groups of 32: gpt_oss.checkpoint_quantization)
            for name, shape in (("gate_up_blocks", (experts, 2 * inter, hidden_size // 2)),
                                ("gate_up_scales", (experts, 2 * inter, hidden_size // GROUP)),
                                ("down_blocks", (experts, hidden_size, inter // 2)),
                                ("down_scales", (experts, hidden_size, inter // GROUP))):
                setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False))
            self.gate_up_proj = self.down_proj = None
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size))
            self.down_proj = nn.Parameter(torch.empty(experts, hidden_size, inter))

    def expert_parameters(self) -> list[torch.Tensor]:
        """The stacked experts' tensors, as stored (for what a decode step reads: benchmarks/decode_latency)."""
        names = _MXFP4 if self.mxfp4 else ("gate_up_proj", "down_proj")
        return [getattr(self, name) for name in (*names, "gate_up_bias", "down_bias")]

    def dequantize_experts(self) -> None:
        """MXFP4 weights into float ones of the biases' dtype (the CPU backend's torch path); a no-op else."""
        if not self.mxfp4:
            return
        dtype = self.gate_up_bias.dtype
        self.gate_up_proj = nn.Parameter(dequantize(self.gate_up_blocks, self.gate_up_scales, dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(dequantize(self.down_blocks, self.down_scales, dtype), requires_grad=False)
        for name in _MXFP4:
            delattr(self, name)
        self.mxfp4 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the normed hidden states [T, H]; returns the experts' weighted sum [T, H]."""
        logits = self.router(x)
        if layers.uses_triton(x):
            weights, expert_ids = route_fused(logits, self.moe.top_k, renormalize=True)
            quantized = dict(gate_up_scales=self.gate_up_scales, down_scales=self.down_scales) if self.mxfp4 else {}
            gate_up = self.gate_up_blocks if self.mxfp4 else self.gate_up_proj
            down = self.down_blocks if self.mxfp4 else self.down_proj
            return gpt_oss_experts(x, weights, expert_ids, gate_up, down, self.gate_up_bias, self.down_bias,
                                   self.alpha, self.limit, **quantized)
        if self.mxfp4:
            raise RuntimeError("MXFP4 experts on the CPU are dequantized at load (dequantize_experts)")
        top, expert_ids = torch.topk(logits, self.moe.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
        return self._combine(x, weights, expert_ids)

    def _combine(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each chosen expert once over its tokens, in ascending order, its weighted output added into their
        rows (transformers' GptOssExperts.forward)."""
        out = torch.zeros_like(x)
        for expert, tokens, expert_weights in tokens_by_expert(expert_ids, weights, self.moe.num_experts):
            gate, up = F.linear(x.index_select(0, tokens), self.gate_up_proj[expert],
                                self.gate_up_bias[expert]).chunk(2, dim=-1)
            y = F.linear(clamped_swiglu(gate, up, self.alpha, self.limit), self.down_proj[expert],
                         self.down_bias[expert])
            out.index_add_(0, tokens, (y * expert_weights[:, None]).to(x.dtype))
        return out
