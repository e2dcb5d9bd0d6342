"""The LoRA layout of a served model (engine/lora/layout.py): this rank's projection shapes, the PEFT
modules that map onto them, and Phi-3's reordered q and k rows (after_load.order_partial_rotary_heads)."""

from __future__ import annotations

import torch

from graphserve.engine.lora.layout import LoraLayout, dense_layout
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.models.loading.after_load import partial_rotary_order


def lora_layout(args: ModelArgs) -> LoraLayout:
    q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    order = None
    if args.rotary_dim is not None:  # the rows order_partial_rotary_heads gives the base weight
        d = args.head_dim
        heads = args.num_heads + args.num_kv_heads
        rows = (torch.arange(heads)[:, None] * d + partial_rotary_order(d, args.rotary_dim)[None, :]).flatten()
        order = torch.cat([rows, torch.arange(heads * d, (heads + args.num_kv_heads) * d)])
    return dense_layout(args.num_layers, args.hidden_size, q_size, kv_size, args.intermediate_size,
                        moe=args.moe is not None, qkv_row_order=order)
