"""The decoder's projections and elementwise operations. On CUDA they run our Triton kernels
(and, for decode-sized batches, our fused matrix-vector kernel); on CPU plain torch (the same
math as the kernels' references, written for speed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.engine.cpu import linear as cpu_linear
from graphserve.engine.cpu import quant_linear

from graphserve.engine.cpu import ops as cpu_ops
from graphserve.engine.lora.apply import LoraWeights, add_lora
from graphserve.engine.lora.rows import LoraRows
from graphserve.engine.models.activation import silu_and_mul
from graphserve.engine.models.fp8 import FP8, fp8_gemm, fp8_linear, quantize_per_channel, quantizes_activations
from graphserve.kernels.fp8_quant import AmaxedRows
from graphserve.kernels.skinny_gemm import SplitPartials, finish_split


# A decoder projection on CUDA runs as our Triton GEMV (kernels/gemv.py), with the RMSNorm before
# it and the SiLU-and-mul (or rotary and the KV-cache write) after it fused in, for a single row;
# otherwise cuBLAS and separate kernels. From benchmarks/gemv_bench.py on an H200 with programmatic
# dependent launch: one row, the GEMV beats the unfused path for every Qwen2.5-0.5B projection
# (2.4 vs 5.6 us for qkv); for Llama-3.1-8B it wins on qkv and o and loses on gate_up (64.5 vs 60.6
# us), yet the whole step is 4.7% faster with it everywhere (fewer kernels: 226 vs 216 tok/s).
# cuBLAS wins for LM heads (90-100% of bandwidth vs 72-85%), which never take the GEMV, and from
# 2 rows on for most shapes (our grid re-reads the weights per row). Benchmarks set GEMV_MAX_ROWS
# to 0 to measure without. (A first tensor-core kernel with the GEMV's fusions for 2-16 rows made
# whole steps slower than cuBLAS, Llama-3.1-8B at batch 2 8.97 vs 4.80 ms, and gave way to the
# skinny GEMM below: 8615439:benchmarks/results/decode_latency-h200-qwen2.5-0.5b-small-gemm-2026-12-01.json.)
GEMV_MAX_ROWS = 1
# FP8 weights: the GEMV dequantizes in registers (weight-only); more rows go W8A8 (engine/models/fp8.py).
FP8_GEMV_MAX_ROWS = 1
# ... except the fused [gate; up] projection, which goes W8A8 from one row on (this many rows and fewer
# take the GEMV): on an H200 the skinny GEMM takes Llama-3.1-8B's gate_up at one row in 33.1 us (83% of
# copy bandwidth), the GEMV in 45.1 (61%), where the GEMV wins on qkv, o and down
# (benchmarks/results/skinny_gemm_bench-fp8-sweep-*, gemv_bench-fp8-sweep-pdl-*).
FP8_GATE_UP_GEMV_MAX_ROWS = 0
# From 2 to this many rows, a bf16/fp16 projection that no kernel above takes runs as
# kernels/skinny_gemm.py (with the SiLU-and-mul fused into gate_up) instead of cuBLAS; engine/models/fp8.py
# decides the same for FP8. H200, Llama-3.1-8B at 8 rows: 110.5 vs 115.1 us for the four
# projections, and 1,744 vs 1,673 tok/s for the whole step (before the fused SiLU). From 32 rows
# cuBLAS wins on gate_up alone (61.9 vs 69.6 us), but with the SiLU fused (one kernel fewer a layer)
# the whole step at 64 rows is faster through the skinny GEMM: 0.5B 54,957 / 55,817 vs 53,157 /
# 53,422 tok/s, 8B 12,159 vs 11,804 (2026-12-02, decode_latency.py --skinny-gemm-max-rows 64 vs 16)
# (benchmarks/results/skinny_gemm_bench-*; the decode A/Bs: cd1cc4d:benchmarks/results/decode_latency-*-skinny-*).
SKINNY_GEMM_MAX_ROWS = 64
# the norm before an FP8 projection hands it its input quantized (kernels/rmsnorm.py rms_norm_fp8)
FP8_NORM_QUANT = True
# The o and down projections' split-K partials (the skinny GEMM splits K where its output tiles leave
# SMs idle) are summed by the residual-add + RMSNorm kernel after them, not a reduce kernel of their
# own: one kernel fewer each, the same bits (one GPU: tensor parallelism all-reduces the summed
# output). H200, interleaved (decode_latency.py --defer-split-reduce on|off): 8B bf16 batch 64 12,677 /
# 12,711 vs 12,448 / 12,454 tok/s, FP8 16,597 / 16,571 vs 16,371 / 16,400; 0.5B batch 64 63,910 vs
# 62,144 (8615439:benchmarks/results/decode_latency-h200-defer-split-reduce-ab-2026-12-02.json).
DEFER_SPLIT_REDUCE = True
# On CUDA the embedding lookup runs as kernels/embedding.py's kernel, which launches with programmatic
# dependent launch (the first layer's kernel then starts, and prefetches its weights, during the lookup),
# instead of torch's index_select. H200, interleaved with sampling.FUSED_MERGE (decode_latency.py
# --pdl-embedding): Qwen2.5-0.5B batch 1 1,844-1,852 against 1,836 / 1,845 tok/s with the merge alone, batch 8
# 10,811 / 10,842 against 10,741 / 10,814 (8615439:benchmarks/results/decode_latency-h200-step-kernels-ab-2026-12-03.json).
PDL_EMBEDDING = True
# An FP8 gate_up (SiLU-and-mul, W8A8 skinny GEMM) hands down_proj its output with each row's amax in parts
# (kernels/skinny_gemm.py row_amax), so the row quantization before down_proj reads those instead of each
# row whole. H200, interleaved (decode_latency.py --fp8-row-amax): Llama-3.1-8B FP8 batch 64 16,783 / 16,834
# against 16,615 / 16,701 tok/s, batch 8 2,688 / 2,692 against 2,662 / 2,658
# (8615439:benchmarks/results/decode_latency-h200-fp8-row-amax-ab-2026-12-03.json).
FP8_ROW_AMAX = True
# Decode attention hands an FP8 o_proj its output with each KV head group's amax the same way
# (kernels/decode_attention.py row_amax, where one split covers each row: Llama-3.1-8B at batch 64 on an
# H200). Interleaved on / off / on / off (decode_latency.py --fp8-attention-amax): 8B FP8 batch 64 17,229 /
# 17,191 against 17,095 / 17,079 tok/s (8615439:benchmarks/results/decode_latency-h200-fp8-attention-amax-ab-2026-12-03.json).
FP8_ATTENTION_AMAX = True


def _triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def uses_triton(x: torch.Tensor) -> bool:
    """Whether x's layer runs the Triton kernels (on CUDA; tests patch _triton to run them in the interpreter)."""
    return _triton(x)


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    if weight.dtype == FP8:
        max_rows = FP8_GATE_UP_GEMV_MAX_ROWS if silu_mul else FP8_GEMV_MAX_ROWS
    else:
        max_rows = GEMV_MAX_ROWS
    return _triton(x) and x.shape[0] <= max_rows


def defers_split_reduce(tp_size: int) -> bool:
    """Whether the o and down projections hand the norm after them their split-K partials unsummed."""
    return DEFER_SPLIT_REDUCE and tp_size == 1


def _summed(x: torch.Tensor | SplitPartials) -> torch.Tensor:
    """x as a tensor, for a consumer that cannot sum split-K partials itself."""
    return finish_split(x) if isinstance(x, SplitPartials) else x


def _fused_projection(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False):
    """The Triton kernel that runs this projection with its neighbours fused in (kernels.gemv.gemv),
    or None (the skinny GEMM, cuBLAS or W8A8, and separate kernels)."""
    if _gemv_applies(x, weight, silu_mul):
        from graphserve.kernels.gemv import gemv

        return gemv
    return None


def hands_row_amax(x: torch.Tensor | SplitPartials, proj: "Linear", after_attention: bool = False) -> bool:
    """Whether the kernel before proj, over x's rows, hands proj its output as AmaxedRows: gate_up before
    down_proj (FP8_ROW_AMAX), or decode attention before o_proj (after_attention, FP8_ATTENTION_AMAX). Where
    proj runs W8A8: FP8 weights on CUDA, rows the GEMV does not take; never to a projection with adapter
    slots (their product reads the rows)."""
    switch = FP8_ATTENTION_AMAX if after_attention else FP8_ROW_AMAX
    return (switch and _triton(x) and proj.weight.dtype == FP8 and quantizes_activations(x.shape[0])
            and not _gemv_applies(x, proj.weight) and proj.lora is None)


def lora_applies(proj: "Linear", rows: LoraRows | None) -> bool:
    """Whether a step's LoRA rows change proj's output: it has adapter slots and some row may use one. The
    fused kernels that never show proj's input or output (the norm, rotary and SiLU around the GEMV, the
    split-K partials handed on) then give way to separate ones."""
    return rows is not None and proj.lora is not None and rows.applies


def _skinny_applies(x: torch.Tensor, lm_head: bool) -> bool:
    return (_triton(x) and not lm_head and 2 <= x.shape[0] <= SKINNY_GEMM_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1)


# A projection whose weight stays GGUF-quantized on CPU (loader, --quantization gguf): its rows in
# parts, in order, each in the quantized kernel's layout (a fused qkv may mix types, as Q4_K_M files do)
QuantizedParts = tuple[quant_linear.QuantizedWeight, ...]


def quantized_linear(x: torch.Tensor, parts: QuantizedParts, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) over a weight kept GGUF-quantized (engine/cpu/quant_linear.py), any row count."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    if len(parts) == 1:
        return quant_linear.quant_linear(x, parts[0], bias)
    y = torch.cat([quant_linear.quant_linear(x, part) for part in parts], dim=1)
    return y if bias is None else y + bias


def pack_weight_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 CPU weight [out, in] repacked for decode-sized batches (engine/cpu/linear.py),
    or None where that does not apply."""
    return cpu_linear.pack_panels(weight)


def linear(x: torch.Tensor | AmaxedRows, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | QuantizedParts | None = None, out_dtype: torch.dtype | None = None,
           scale: torch.Tensor | None = None, lm_head: bool = False, silu_mul: bool = False,
           defer_reduce: bool = False) -> torch.Tensor | SplitPartials:
    """x @ weight.T (+ bias); out_dtype: the result (rounded to x's dtype first) in this dtype.
    An FP8 weight comes with its per-output-channel `scale` (engine/models/fp8.py); x may then be
    AmaxedRows (hands_row_amax), whose quantization takes each row's amax from it.
    lm_head: the vocabulary projection (cuBLAS, never the GEMV). silu_mul: weight is a fused
    [gate; up] and the result silu(gate) * up, fused into the projection where its kernel can.
    defer_reduce (see defers_split_reduce): a product the skinny GEMM splits over K comes back as
    its SplitPartials, which norm_linear and add_rms_norm take. packed: the CPU panels, or the
    weight's GGUF-quantized parts (then `weight` holds no data, only the shape)."""
    if isinstance(packed, tuple):
        y = quantized_linear(x, packed, bias)
        y = silu_and_mul(y) if silu_mul else y
        return y if out_dtype is None else y.to(out_dtype)
    defer_reduce = defer_reduce and out_dtype is None
    if isinstance(x, AmaxedRows):
        if weight.dtype != FP8:
            x = x.rows
        else:
            y = fp8_linear(x, weight, scale, bias, silu_mul=silu_mul, defer_reduce=defer_reduce)
            return y if out_dtype is None else y.to(out_dtype)
    kernel = None if lm_head else _fused_projection(x, weight, silu_mul)
    if kernel is not None:
        return kernel(x, weight, bias, out_dtype=out_dtype, weight_scale=scale, silu_mul=silu_mul)[0]
    if weight.dtype == FP8:
        y = fp8_linear(x, weight, scale, bias, silu_mul=silu_mul, defer_reduce=defer_reduce)
        return y if out_dtype is None else y.to(out_dtype)
    if _skinny_applies(x, lm_head):
        from graphserve.kernels.skinny_gemm import skinny_gemm

        y = skinny_gemm(x, weight, bias, silu_mul=silu_mul, defer_reduce=defer_reduce)
        return y if out_dtype is None else y.to(out_dtype)
    if cpu_linear.applies(x, packed):
        y = cpu_linear.panel_linear(x, packed, weight.shape[0], bias)
    else:
        y = F.linear(x, weight, bias)
    y = silu_and_mul(y) if silu_mul else y
    return y if out_dtype is None else y.to(out_dtype)


class Linear(nn.Linear):
    """nn.Linear that uses a packed weight on CPU once `pack_for_cpu()` ran, an FP8 weight
    with per-output-channel scales once `to_fp8()` ran (or the loader filled one), or a GGUF-quantized
    weight once `keep_quantized()` ran."""

    packed: torch.Tensor | QuantizedParts | None = None
    lora: LoraWeights | None = None  # this projection's LoRA adapter slots (engine/runner/lora_slots.py)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_parameter("weight_scale", None)  # float32 [out] once the weight is FP8

    def pack_for_cpu(self) -> None:
        if not isinstance(self.packed, tuple):  # a quantized weight stays as it is
            self.packed = pack_weight_for_cpu(self.weight)

    def keep_quantized(self, parts: QuantizedParts) -> None:
        """Serve the weight from its GGUF-quantized parts (rows in order); the float weight is dropped
        (a zero-stride view keeps its shape, which callers read, and no memory)."""
        assert sum(part.n for part in parts) == self.out_features and all(part.k == self.in_features for part in parts)
        self.packed = parts
        self.weight = nn.Parameter(torch.zeros((), dtype=self.weight.dtype).expand(self.out_features, self.in_features),
                                   requires_grad=False)

    def to_fp8(self, quantize: bool = True) -> None:
        """The weight in float8 e4m3 with a float32 scale per output row: quantized from the
        current weight, or (quantize=False) empty, for a pre-quantized checkpoint to fill."""
        if quantize:
            q, scale = quantize_per_channel(self.weight.data)
        else:
            q = torch.empty(self.weight.shape, dtype=FP8, device=self.weight.device)
            scale = torch.empty(self.weight.shape[0], dtype=torch.float32, device=self.weight.device)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor, defer_reduce: bool = False,
                lora: LoraRows | None = None) -> torch.Tensor | SplitPartials:
        """lora: the step's LoRA rows, whose adapters add their product (then the result is summed)."""
        if lora_applies(self, lora):
            x = x.rows if isinstance(x, AmaxedRows) else x
            y = linear(x, self.weight, self.bias, self.packed, scale=self.weight_scale)
            return add_lora(y, x, self.lora, lora)
        return linear(x, self.weight, self.bias, self.packed, scale=self.weight_scale, defer_reduce=defer_reduce)


def norm_linear(x: torch.Tensor | SplitPartials, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                proj: Linear, silu_mul: bool = False, row_amax: bool = False,
                lora: LoraRows | None = None) -> tuple[torch.Tensor | AmaxedRows, torch.Tensor]:
    """A decoder sub-block's input side: h = rmsnorm(x + residual) * norm_weight (rmsnorm(x) when
    residual is None), y = proj(h), then silu(gate) * up when silu_mul. Returns (y, x + residual).
    Decode-sized batches on CUDA do all of it in one kernel. x may be the previous projection's
    split-K partials (defers_split_reduce), with a residual. row_amax (hands_row_amax): y may come
    as AmaxedRows. lora: the step's LoRA rows; their adapters' product is added to y before the SiLU."""
    if lora_applies(proj, lora):
        if _triton(x):  # the norm stays in the projection's kernel: the adapter's kernels norm x + residual again
            y, residual = norm_linear(x, residual, norm_weight, eps, proj)
            return add_lora(y, residual, proj.lora, lora, norm=(norm_weight, eps), silu_mul=silu_mul), residual
        if residual is None:
            h, residual = rms_norm(x, norm_weight, eps), x
        else:
            h, residual = add_rms_norm(x, residual, norm_weight, eps)
        y = add_lora(linear(h, proj.weight, proj.bias, proj.packed, scale=proj.weight_scale), h, proj.lora, lora)
        return (silu_and_mul(y) if silu_mul else y), residual
    kernel = _fused_projection(x, proj.weight, silu_mul)
    if kernel is not None:
        y, new_residual = kernel(_summed(x), proj.weight, proj.bias, norm_weight=norm_weight, residual=residual,
                                 eps=eps, silu_mul=silu_mul, weight_scale=proj.weight_scale)
        return y, x if residual is None else new_residual
    if _triton(x) and proj.weight.dtype == FP8 and FP8_NORM_QUANT and quantizes_activations(x.shape[0]):
        # the norm hands the projection its input already quantized: one kernel fewer
        from graphserve.kernels.rmsnorm import rms_norm_fp8

        xq, x_scale, new_residual = rms_norm_fp8(x, norm_weight, eps, residual)
        y = fp8_gemm(xq, x_scale, proj.weight, proj.weight_scale, proj.bias, x.dtype, silu_mul, row_amax=row_amax)
        return y, x if residual is None else new_residual
    if residual is None:
        h, residual = rms_norm(x, norm_weight, eps), x
    else:
        h, residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, proj.weight, proj.bias, proj.packed, scale=proj.weight_scale, silu_mul=silu_mul), residual


def fused_qkv_rope_store(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         qkv_proj: Linear, num_heads: int, positions: torch.Tensor, cos_sin: torch.Tensor,
                         slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Decode attention's input side in one kernel where the fused GEMV applies: norm, qkv
    projection, rotary of q and k, K/V written into the cache. Returns (rotated q [M, Hq, D],
    x + residual), or None elsewhere (the caller runs norm_linear and the backend's rotary + store)."""
    if not _gemv_applies(x, qkv_proj.weight):
        return None
    from graphserve.kernels.gemv import gemv_rope_store

    x = _summed(x)
    q, new_residual = gemv_rope_store(x, qkv_proj.weight, qkv_proj.bias, positions, cos_sin, slot_mapping, k_cache,
                                      v_cache, num_heads, norm_weight=norm_weight, residual=residual, eps=eps,
                                      weight_scale=qkv_proj.weight_scale)
    return q, x if residual is None else new_residual


def embed(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[ids]: the embedding lookup (kernels/embedding.py on CUDA where PDL_EMBEDDING)."""
    if PDL_EMBEDDING and _triton(ids):
        from graphserve.kernels.embedding import embedding

        return embedding(ids, weight)
    return F.embedding(ids, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _triton(x):
        from graphserve.kernels.rmsnorm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        fused = cpu_ops.add_rms_norm(x, None, weight, eps)  # one pass in C, where it applies
        if fused is not None:
            return fused[0]
        # one op, bit for bit the lines below (and transformers' LlamaRMSNorm) in float32
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor | SplitPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); x may be split-K partials (on CUDA)."""
    if _triton(x):
        from graphserve.kernels.rmsnorm import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps)
    fused = cpu_ops.add_rms_norm(x, residual, weight, eps)
    if fused is not None:
        return fused
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_tables(positions: torch.Tensor, cos_sin: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [T, 1, D] for `positions`: cos repeated over both halves, sin negated
    on the first half, so that rotary is x * cos + roll(x, D/2) * sin (see apply_rotary).
    Depends on the positions only: the CPU attention backend makes them once per step."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions].to(dtype)
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style (rotate_half) rotary embedding; q [T, Hq, D], k [T, Hkv, D]. CPU path:
    on CUDA the Triton attention backend fuses rotary with the KV store. When q and k are
    neighbouring head slices of one fused qkv tensor (as in our decoder) both rotate in one pass.
    `tables`: rotary_tables(positions, ...) made beforehand.

    x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1], is computed as
    x * cos + [x2, x1] * [-sin, sin]: the same products and sums (a + (-b) is a - b exactly),
    bit for bit, in three elementwise ops."""
    half = q.shape[-1] // 2
    cos, sin = tables if tables is not None else rotary_tables(positions, cos_sin, q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(half, dims=-1) * sin

    num_q = q.shape[1]
    if k.data_ptr() == q.data_ptr() + num_q * q.stride(1) * q.element_size() and q.stride() == k.stride():
        qk = q.as_strided((q.shape[0], num_q + k.shape[1], q.shape[2]), q.stride())
        rotated = rotate(qk)
        return rotated[:, :num_q], rotated[:, num_q:]
    return rotate(q), rotate(k)
