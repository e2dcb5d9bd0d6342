"""What an architecture's weights become once the checkpoint is read: Gemma 3's norms (1 + w) and its
local layers' rotary table, Phi-3's partial rotary as an order of each head's dims, and gpt-oss's MXFP4
experts dequantized where the CPU backend serves them."""

from __future__ import annotations

import torch

from graphserve.engine.models.config import ModelArgs
from graphserve.engine.models.llama import LlamaModel
from graphserve.engine.models.moe.gpt_oss import GptOssMoE
from graphserve.kernels.rotary import build_cos_sin_cache


def after_load(model: LlamaModel, args: ModelArgs, max_positions: int, device: torch.device, dummy: bool) -> None:
    """The transforms `args` calls for, in place (dummy: the weights are random, not a checkpoint's)."""
    if args.gemma is not None:
        gemma_after_load(model, args, max_positions, device, dummy)
    if args.rotary_dim is not None:  # partial rotary: each q and k head's dims in the order rotary takes them
        order_partial_rotary_heads(model, args.rotary_dim)
    if device.type != "cuda":  # gpt-oss's MXFP4 experts: the CPU backend's torch path reads float weights
        for module in model.modules():
            if isinstance(module, GptOssMoE):
                module.dequantize_experts()


def gemma_after_load(model: LlamaModel, args: ModelArgs, max_positions: int, device: torch.device,
                     dummy: bool) -> None:
    """Gemma 3: each RMSNorm's weight w becomes 1 + w (computed in float32, as Gemma3RMSNorm multiplies),
    so the norms run as every other model's; the sliding layers' rotary table (rope_local_base_freq)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                if dummy:  # random weights: Gemma's norms start at 0 (a weight of 1)
                    p.zero_()
                p.copy_((1.0 + p.float()).to(p.dtype))
    model.cos_sin_local = build_cos_sin_cache(args.head_dim, max_positions, args.gemma.local_rope_theta).to(device)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims under which rotate_half over all head_dim dims, with cos 1 and sin 0
    on the columns past rotary_dim / 2 (build_cos_sin_cache), rotates dims [0, rotary_dim) as
    transformers' partial rotary does (pairs (i, i + rotary_dim / 2)) and leaves the others: new dim
    j holds old dim order[j]. q . k is a sum over dims, so the same order in q and k changes nothing."""
    half, rhalf = head_dim // 2, rotary_dim // 2
    rest = (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(rhalf), rotary_dim + torch.arange(rest),
                      rhalf + torch.arange(rhalf), rotary_dim + rest + torch.arange(rest)])


def order_partial_rotary_heads(model: LlamaModel, rotary_dim: int) -> None:
    """Reorder each q and k head's rows of every qkv projection (and their per-row FP8 scales or bias)."""
    args = model.shard.local
    d = args.head_dim
    order = partial_rotary_order(d, rotary_dim)
    heads = args.num_heads + args.num_kv_heads
    rows = (torch.arange(heads)[:, None] * d + order[None, :]).flatten()
    rows = torch.cat([rows, torch.arange(heads * d, (heads + args.num_kv_heads) * d)])  # v stays
    with torch.no_grad():
        for layer in model.layers:
            proj = layer.self_attn.qkv_proj
            for tensor in (proj.weight, proj.weight_scale, proj.bias):
                if tensor is not None:
                    data = tensor.data.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor.data
                    data.copy_(data.index_select(0, rows.to(data.device)))
