"""A LlamaModel's decode steps on the CPU in one C call for all its layers (engine/cpu/decoder.py),
where every layer fits the stack: a dense MLP, no per-head q/k norms (a sliding window is taken), one rank, float32, each
projection in the quantized kernel's layout or in float32 panels, the C attention kernel. The
numbers are the per-layer path's, bit for bit: only its Python goes. Rows with a LoRA adapter take
the stack too: its product comes after each projection from the kernel the per-layer path calls
(engine/cpu/lora.py)."""

from __future__ import annotations

import torch

from graphserve.engine.cpu import decoder
from graphserve.engine.cpu.decoder import LayerWeights, Projection, Shape, StackDecoder
from graphserve.engine.models.attention import AttentionMetadata, TorchAttention, step_rotary_tables
from graphserve.engine.models.layers import Linear


def _projection(proj: Linear) -> Projection | None:
    if isinstance(proj.packed, tuple):  # GGUF-quantized parts
        parts = proj.packed
    elif isinstance(proj.packed, torch.Tensor):  # float32 panels
        parts = ((proj.packed, proj.weight.shape[0]),)
    else:
        return None
    if len(parts) > decoder.MAX_PARTS:
        return None
    return Projection(parts, proj.bias.detach() if proj.bias is not None else None)


def stack_decoder(model) -> StackDecoder | None:
    """The model's StackDecoder, or None where a layer (or this machine) does not fit it."""
    if model.tp.size != 1 or model.embed_tokens.weight.device.type != "cpu" \
            or model.embed_tokens.weight.dtype != torch.float32 or model.args.head_dim % 2 or not decoder.available():
        return None
    layers = []
    for layer in model.layers:
        attn = layer.self_attn
        if layer.is_moe or attn.q_norm is not None or not getattr(layer, "fits_stack", True) or not isinstance(attn.backend, TorchAttention) \
                or not attn.backend.use_kernel:
            return None
        projections = [_projection(p) for p in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj,
                                                layer.mlp.down_proj)]
        if any(p is None for p in projections):
            return None
        layers.append(LayerWeights(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                                   *projections, window=attn.window))
    args = model.shard.local
    first = model.layers[0]
    return StackDecoder(layers, Shape(args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
                                      args.intermediate_size, first.self_attn.backend.block_size,
                                      first.input_layernorm.eps, first.self_attn.scale))


# a layer's projections in the stack's order (decoder.PROJECTIONS): (its module, the projection)
_LORA_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                     ("mlp", "down_proj"))


def _lora_projections(layers) -> tuple | None:
    """Per layer, its four projections' adapter slots as the C kernel takes them (None where one has no
    slots), or None where a projection's slots are not the kernel's (not float32)."""
    out = []
    for layer in layers:
        for module, name in _LORA_PROJECTIONS:
            weights = getattr(getattr(layer, module), name).lora
            projection = None if weights is None else weights.cpu_projection()
            if weights is not None and projection is None:
                return None
            out.append(projection)
    return tuple(out)


def decode_stack(stack: StackDecoder, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 layers) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the last layer's output, the residual) of a decode step, or None where the stack does not
    take this step (the caller runs the layers one by one): a prefill, a batch it does not take, rows
    with a LoRA adapter whose slots the C kernel does not take. layers: the model's (their
    projections' LoRA slots)."""
    if meta.is_prefill or not stack.applies(x):
        return None
    lora_slots = None
    if meta.lora is not None and meta.lora.applies:
        if not stack.lora_attached:  # the slots stay where they are: their views are taken once
            projections = _lora_projections(layers) if decoder.takes_lora() else None
            if projections is None:
                return None
            stack.attach_lora(projections)
        lora_slots = meta.lora.slots
    cos, sin = (t.reshape(x.shape[0], -1) for t in step_rotary_tables(meta, positions, cos_sin, x.dtype))
    groups = meta.groups or (meta,)  # each KV cache group's slots and tables
    return stack.run(x, cos, sin, [g.slot_mapping for g in groups], [g.block_tables for g in groups],
                     meta.context_lens, kv_caches, meta.layer_groups, lora_slots=lora_slots)
