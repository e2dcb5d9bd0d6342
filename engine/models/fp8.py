"""FP8 weights (float8 e4m3) with one float32 scale per output channel: quantization at load
(`--quantization fp8`), the layout of pre-quantized checkpoints, and the projection.

w ≈ q * scale[:, None], scale = max|w[row]| / 448 (e4m3's largest finite value). On CUDA
the projection quantizes each activation row the same way on the fly (dynamic per-token
scales, kernels/fp8_quant.py) and multiplies in FP8 on the tensor cores (kernels/skinny_gemm.py or torch._scaled_mm, W8A8); on CPU it
dequantizes the weight (a reference path: correct, not fast). The embedding and the LM
head stay in the model's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphserve.engine.models.activation import silu_and_mul

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = 1e-12  # an all-zero row still gets a usable scale
# Up to this many rows the W8A8 product runs as kernels/skinny_gemm.py, beyond it torch._scaled_mm:
# on an H200 the Triton kernel takes Llama-3.1-8B's four projections at 64 rows in 86 us against
# 124 us, and loses from 128 rows on (benchmarks/results/skinny_gemm_bench-h200-*.json).
FP8_GEMM_MAX_ROWS = 64
# Up to this many rows (from 2: one row is the GEMV's, engine/models/layers.py) the weights would be
# turned to fp16 in registers with x kept bf16 (kernels/skinny_gemm.py weight-only: no activation
# quantization, no rounding of x to e4m3). Measured on an H200 it loses to W8A8 (the conversion
# costs more than the activation quantization saves): Llama-3.1-8B at 8 rows gate_up 46.1 vs
# 33.9 us, qkv 14.3 vs 12.8, o 10.3 vs 9.6 (down 24.1 vs 25.8, W8A8's quantization included), and
# the whole step at batch 8 / 16 1,804 / 3,631 vs 2,291 / 4,403 tok/s
# (cd1cc4d:benchmarks/results/skinny_gemm_bench-fp8-weight-only-*, and decode_latency-*-fp8-{w8a8,weight-only}-*
# there). So 0: W8A8 from 2 rows. decode_latency.py --fp8-weight-only-max-rows A/Bs it.
FP8_WEIGHT_ONLY_MAX_ROWS = 0


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> (e4m3 [..., out, in], float32 scales [..., out]): a stack of experts'
    weights [E, out, in] gets a scale per expert and output channel."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp(min=_TINY) / FP8_MAX
    return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_experts(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_channel of [E, out, in] one expert at a time (a float32 copy of one expert, not
    of all of them, at once)."""
    q = torch.empty(stacked.shape, dtype=FP8, device=stacked.device)
    scale = torch.empty(stacked.shape[:2], dtype=torch.float32, device=stacked.device)
    for expert in range(stacked.shape[0]):
        q[expert], scale[expert] = quantize_per_channel(stacked[expert])
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., out, in] with scales [..., out] back to `dtype`."""
    return (q.float() * scale[..., None].float()).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): one scale per row (token)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               silu_mul: bool = False, defer_reduce: bool = False) -> torch.Tensor:
    """x [..., in] @ (q * scale).T (+ bias), in x's dtype; silu_mul: q is a fused [gate; up] and
    the result silu(gate) * up; defer_reduce: see fp8_gemm (x [M, in] only). x may be AmaxedRows
    [M, in] (kernels/fp8_quant.py): its rows, whose quantization then reads their amax from it."""
    from graphserve.kernels.fp8_quant import AmaxedRows, quantize_rows_fp8  # quantize_rows in one kernel, bit for bit

    if isinstance(x, AmaxedRows):
        xq, x_scale = quantize_rows_fp8(x)
        return fp8_gemm(xq, x_scale, q, scale, bias, x.rows.dtype, silu_mul, defer_reduce=defer_reduce)
    if not x.is_cuda:
        y = F.linear(x, dequantize(q, scale, x.dtype), bias)
        if silu_mul:
            y = silu_and_mul(y)
        return y
    from graphserve.kernels.skinny_gemm import skinny_gemm

    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= FP8_WEIGHT_ONLY_MAX_ROWS and rows.stride(-1) == 1:
        y = skinny_gemm(rows, q, bias, weight_scale=scale, out_dtype=x.dtype, silu_mul=silu_mul)
        return y.view(*x.shape[:-1], y.shape[-1])
    xq, x_scale = quantize_rows_fp8(rows)
    y = fp8_gemm(xq, x_scale, q, scale, bias, x.dtype, silu_mul, defer_reduce=defer_reduce and x.dim() == 2)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def quantizes_activations(rows: int) -> bool:
    """Whether an FP8 projection of this many rows on CUDA takes its activations in FP8 (W8A8),
    so a kernel before it may hand them over quantized (kernels/rmsnorm.py's rms_norm_fp8)."""
    return rows > FP8_WEIGHT_ONLY_MAX_ROWS


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, silu_mul: bool = False,
             defer_reduce: bool = False, row_amax: bool = False) -> torch.Tensor:
    """W8A8 on CUDA: activations xq [M, in] e4m3 with scales x_scale [M, 1], weight q with scale;
    the result in out_dtype (silu(gate) * up when silu_mul). defer_reduce: a product the skinny
    GEMM splits over K may come back unsummed (kernels/skinny_gemm.SplitPartials). row_amax: the
    skinny GEMM's result may come as AmaxedRows, for the next W8A8 projection's quantization."""
    from graphserve.kernels.skinny_gemm import skinny_gemm

    if xq.shape[0] <= FP8_GEMM_MAX_ROWS:
        return skinny_gemm(xq, q, bias, x_scale=x_scale, weight_scale=scale, out_dtype=out_dtype, silu_mul=silu_mul,
                           defer_reduce=defer_reduce, row_amax=row_amax)
    y = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale[None, :], bias=bias, out_dtype=out_dtype)
    if silu_mul:
        y = silu_and_mul(y)
    return y


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the CUDA path computes beyond FP8_WEIGHT_ONLY_MAX_ROWS rows, in float32 on any device:
    activations quantized per row too."""
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_rows(rows)
    y = (xq.float() * x_scale) @ dequantize(q, scale, torch.float32).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], q.shape[0])
