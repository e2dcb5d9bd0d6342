"""Decoder for the Llama family: Llama 2/3/3.1, Mistral, SmolLM2, Qwen2 (QKV bias), Qwen3 (q/k norm),
Phi-3/Phi-4 (fused checkpoint projections, partial rotary by a head-dim order: after_load.partial_rotary_order),
Gemma 3's text model (GemmaDecoderLayer, engine/models/hf_config/gemma3.py),
and the mixtures of experts on that frame: Qwen3-MoE and Mixtral (engine/models/moe/sparse.py as the MLP), gpt-oss
(attention sinks and an o bias; engine/models/moe/gpt_oss.py as the MLP).

Weights use fused projections (qkv, gate_up); the loader fills them from HF tensors.
The model reads attention metadata and the KV cache from its arguments only. Under tensor
parallelism (engine/distributed.py) each rank builds the layers of its shard and sums the
row-parallel outputs (O, down) and the vocabulary-split embedding with an all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.engine.cpu.decoder import StackDecoder
from graphserve.engine.distributed import SINGLE, TensorParallel
from graphserve.engine.models.attention import AttentionMetadata
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.models.cpu_stack import decode_stack
from graphserve.engine.models.moe.gpt_oss import GptOssMoE
from graphserve.engine.models.moe.sparse import SparseMoE
from graphserve.engine.models.sharding import shard_for
from graphserve.engine.models.layers import (
    Linear,
    add_rms_norm,
    defers_split_reduce,
    embed,
    fused_qkv_rope_store,
    hands_row_amax,
    linear,
    lora_applies,
    norm_linear,
    pack_weight_for_cpu,
    rms_norm,
)
from graphserve.kernels.fp8_quant import AmaxedRows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, backend, tp: TensorParallel = SINGLE, window: int | None = None):
        super().__init__()
        self.window = window  # the layer's sliding window (engine/models/hf_config/windows.py), None: full attention
        self.tp = tp  # args: this rank's heads
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.gpt_oss is not None and args.qkv_bias)
        # gpt-oss: each head's learned sink logit, a term of its softmax's denominator
        self.register_parameter("sinks", nn.Parameter(torch.empty(self.num_heads)) if args.gpt_oss else None)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.scale = self.head_dim**-0.5 if args.gemma is None else args.gemma.query_pre_attn_scalar**-0.5
        self.backend = backend
        # the o projection may hand the add + norm after it split-K partials (not Gemma's: a norm of its own)
        self.defer_output = args.gemma is None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, positions: torch.Tensor,
                cos_sin: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual), the qkv projection, rotary, the KV-cache write, attention and the output
        projection. Returns (output, x + residual); the output may be the o projection's split-K
        partials, for the norm after it to sum (layers.defers_split_reduce)."""
        num_tokens = x.shape[0]
        row_amax = hands_row_amax(x, self.o_proj, after_attention=True)
        fused = None
        if not meta.is_prefill and self.q_norm is None and not lora_applies(self.qkv_proj, meta.lora):
            fused = fused_qkv_rope_store(x, residual, norm.weight, norm.eps, self.qkv_proj, self.num_heads, positions,
                                         cos_sin, meta.slot_mapping, k_cache, v_cache)
        if fused is not None:
            q, residual = fused
            out = self.backend.attend_decode(q, k_cache, v_cache, meta, self.scale, row_amax=row_amax,
                                             window=self.window, sinks=self.sinks)
        else:
            qkv, residual = norm_linear(x, residual, norm.weight, norm.eps, self.qkv_proj, lora=meta.lora)
            heads = qkv.view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            out = self.backend.forward(q, k, v, positions, cos_sin, k_cache, v_cache, meta, self.scale,
                                       row_amax=row_amax and not meta.is_prefill, qk_norm=qk_norm,
                                       window=self.window, sinks=self.sinks)
        if isinstance(out, AmaxedRows):  # [T, Hq * D] already
            o_input = out
        else:
            o_input = out.reshape(num_tokens, self.q_size)
        defer = self.defer_output and defers_split_reduce(self.tp.size)
        return self.tp.all_reduce(self.o_proj(o_input, defer_reduce=defer, lora=meta.lora)), residual


class MLP(nn.Module):
    """SwiGLU MLP; the decoder layer runs gate_up (with the norm before it and the activation)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    local_rope = False  # every layer takes the model's one rotary table

    def __init__(self, args: ModelArgs, backend, tp: TensorParallel = SINGLE, index: int = 0):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(args, backend, tp, window=args.window(index))
        if args.gpt_oss is not None:
            self.mlp = GptOssMoE(args.hidden_size, args.moe, args.gpt_oss, mxfp4=args.quantization == "mxfp4")
        else:
            self.mlp = SparseMoE(args.hidden_size, args.moe) if args.moe is not None else MLP(args)
        self.is_moe = args.moe is not None
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, residual, positions, cos_sin, meta, k_cache, v_cache):
        """x: the previous layer's output (the embeddings for the first, with residual None), a
        tensor or its down projection's split-K partials (layers.defers_split_reduce)."""
        h, residual = self.self_attn(x, residual, self.input_layernorm, positions, cos_sin, meta, k_cache, v_cache)
        norm, mlp = self.post_attention_layernorm, self.mlp
        if self.is_moe:  # each rank ran its columns of every expert: the sum, as the dense MLP's down_proj
            experts_input, residual = add_rms_norm(h, residual, norm.weight, norm.eps)
            return self.tp.all_reduce(mlp(experts_input)), residual
        act, residual = norm_linear(h, residual, norm.weight, norm.eps, mlp.gate_up_proj, silu_mul=True,
                                    row_amax=hands_row_amax(h, mlp.down_proj), lora=meta.lora)
        down = mlp.down_proj(act, defer_reduce=defers_split_reduce(self.tp.size), lora=meta.lora)
        return self.tp.all_reduce(down), residual


class GemmaDecoderLayer(nn.Module):
    """Gemma 3's layer: RMSNorms after attention and after the MLP too (each norm's weight holds Gemma's
    1 + w, folded in at load), a GeGLU MLP (gelu_pytorch_tanh), q/k norms; a sliding layer takes the local
    rotary table (local_rope)."""

    fits_stack = False  # not the CPU decode stack's layer (engine/models/cpu_stack.py)

    def __init__(self, args: ModelArgs, backend, tp: TensorParallel = SINGLE, index: int = 0):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(args, backend, tp, window=args.window(index))
        self.local_rope = args.window(index) is not None
        self.mlp = MLP(args)
        self.is_moe = False
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(args.hidden_size, args.rms_norm_eps))

    def forward(self, x, residual, positions, cos_sin, meta, k_cache, v_cache):
        h, residual = self.self_attn(x, residual, self.input_layernorm, positions, cos_sin, meta, k_cache, v_cache)
        h = rms_norm(h, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        norm = self.pre_feedforward_layernorm
        h, residual = add_rms_norm(h, residual, norm.weight, norm.eps)
        act = gelu_tanh_and_mul(self.mlp.gate_up_proj(h, lora=meta.lora))
        out = self.tp.all_reduce(self.mlp.down_proj(act, lora=meta.lora))
        return rms_norm(out, self.post_feedforward_layernorm.weight, self.post_feedforward_layernorm.eps), residual


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_pytorch_tanh(gate) * up over a fused [gate; up] row (transformers' GeGLU, in the rows' dtype)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class LlamaModel(nn.Module):
    """Causal LM: forward() gives final hidden states, compute_logits() the logits."""

    def __init__(self, args: ModelArgs, backend, cos_sin: torch.Tensor, tp: TensorParallel = SINGLE):
        super().__init__()
        self.args = args  # the whole model's shape
        self.tp = tp
        self.shard = shard_for(args, tp)
        local, rows = self.shard.local, self.shard.vocab_rows
        # an empty table given, so no random init runs: on the meta device torch's normal_ would import
        # torch._dynamo (seconds of every start) to initialize weights the checkpoint replaces anyway
        self.embed_tokens = nn.Embedding(rows, args.hidden_size, _weight=torch.empty(rows, args.hidden_size))
        layer = GemmaDecoderLayer if args.gemma is not None else DecoderLayer
        self.layers = nn.ModuleList([layer(local, backend, tp, i) for i in range(args.num_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, rows, bias=False)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        self.cos_sin_local: torch.Tensor | None = None  # Gemma 3's sliding layers' rotary table (the loader's)
        self.lm_head_packed: torch.Tensor | None = None
        self.cpu_stack: StackDecoder | None = None  # made by the loader where the model fits it

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = self._embed(input_ids)
        if self.args.gemma is not None:  # Gemma scales its embeddings by sqrt(hidden), rounded to the dtype
            x = x * float(torch.tensor(self.args.hidden_size**0.5).to(x.dtype))
        stacked = None if self.cpu_stack is None else decode_stack(self.cpu_stack, x, positions, self.cos_sin, meta,
                                                                   kv_caches, self.layers)
        if stacked is not None:  # a CPU decode step: every layer in one C call (engine/models/cpu_stack.py)
            x, residual = stacked
        else:
            residual = None
            local = self.cos_sin_local
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
                cos_sin = local if local is not None and layer.local_rope else self.cos_sin
                x, residual = layer(x, residual, positions, cos_sin, meta.for_layer(i), k_cache, v_cache)
        x, _ = add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x

    @property
    def kv_args(self) -> ModelArgs:
        """The shape of this rank's KV cache (its KV heads)."""
        return self.shard.local

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return embed(input_ids, self.embed_tokens.weight)
        start, end = self.shard.vocab
        local = input_ids - start
        mine = (local >= 0) & (local < end - start)  # the other ranks hold the other rows
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine[:, None].to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Logits in `dtype` (None: the model's dtype), rounded to the model's dtype first; under
        tensor parallelism gathered whole on every rank."""
        cap = None if self.args.gemma is None else self.args.gemma.final_logit_softcapping
        logits = linear(hidden, self.lm_head_weight, packed=self.lm_head_packed, out_dtype=None if cap else dtype,
                        lm_head=True)
        if cap:  # Gemma: cap * tanh(logits / cap), in the model's dtype as transformers computes it
            logits = (torch.tanh(logits / cap) * cap).to(dtype or logits.dtype)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[..., :self.args.vocab_size]

    def pack_for_cpu(self) -> None:
        """Pack every projection (and the LM head) for the CPU panel kernel; a no-op off CPU or float32."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        self.lm_head_packed = pack_weight_for_cpu(self.lm_head_weight)
