"""Projections for decode batches, out = x @ w.T (+ bias) for x [M, K] with 2 to ~64 rows, on the
tensor cores: bf16 / fp16 / fp32 operands; W8A8 FP8 (x and w float8 e4m3, one float32 scale
per row of each: out = (x * x_scale) @ (w * w_scale).T); or weight-only FP8 (x bf16 / fp16, w
e4m3 with its row scales: out = x @ (w * w_scale).T, the weights turned to fp16 in registers,
which holds every e4m3 value exactly, and x scaled by 2^-8 into fp16's range, which no
activation leaves: the tensor cores multiply fp16, accumulating in float32).

cuBLAS picks tiles for these shapes that leave bandwidth unused: torch._scaled_mm reaches about
2 TB/s of an H200's 4.8 on Llama-3.1-8B's FP8 projections at 64 rows, and the bf16 GEMMs split K
into a GEMM and a reduce kernel at 8 rows (benchmarks/results/profile_decode-*). At so few rows the
weights are all the traffic, so the kernel is built around reading them:

- swap AB: each program multiplies a BLOCK_N x BLOCK_K weight tile by the transposed activations
  (tl.dot(w, x.T)), so the weights fill the tensor cores' 64-row side and the rows (8 to 64) the
  narrow side;
- split K: a projection with few output tiles (Llama-3.1-8B's down_proj: 32 tiles of 128 outputs)
  cuts K into SPLIT parts, each written as float32 partials that a second kernel sums in a fixed
  order (so results never depend on timing), then scales, adds the bias and rounds; or, with
  defer_reduce, the kernel after the projection does that as it reads them (the decoder's residual-add
  + RMSNorm, kernels/rmsnorm.py: one kernel fewer). (Summing them in
  the last split of each tile to finish, as decode attention merges its splits, was measured slower
  on an H200: Qwen2.5-0.5B batch 64 60,549 / 60,885 against 62,469 / 63,051 tok/s,
  8615439:benchmarks/results/decode_latency-h200-skinny-fused-reduce-ab-2026-12-02.json);
- the K loop is software-pipelined through shared memory (num_stages); for W8A8 from 33 rows
  (W8A8_TMA_MIN_ROWS, W8A8_TMA_SILU_MIN_ROWS) the copy engine (TMA, host tensor descriptors) fills the stages, one request a tile, instead of
  every thread's cp.async (_skinny_gemm_tma_kernel).

Launch parameters depend on shapes only (CUDA-graph capturable). skinny_gemm_ref is the float32
reference (for FP8, engine/models/fp8.py's fp8_linear_ref computes the same).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from graphserve.kernels.launch_settings import dot_precision, sm_count, use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel
from graphserve.kernels.fp8_quant import AmaxedRows

FP8 = torch.float8_e4m3fn
# weight-only FP8: x * 2^-8 in fp16 overflows only past 16.7M, and loses bits only below 2^-16
# (absolute error < 2^-17 there), far finer than x's own bf16 rounding; the result is scaled back
W_ONLY_X_SCALE = tl.constexpr(2.0**-8)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, amax_ptr,
    M, N, K, k_per_split,
    stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    W_ONLY: tl.constexpr,
    SILU_MUL: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IMPRECISE_K: tl.constexpr,
    ROW_AMAX: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    if SILU_MUL:  # up row N + n beside gate row n
        u_ptrs = w_ptrs + N * stride_w
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    if PDL:
        wait_for_previous_kernel()

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SILU_MUL:
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + tl.arange(0, BLOCK_K)) < k_end
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if W_ONLY:  # e4m3 weights are exact in fp16; x scaled into fp16's range (see W_ONLY_X_SCALE)
            x = (x.to(tl.float32) * W_ONLY_X_SCALE).to(tl.float16)
            w = w.to(tl.float16)
        acc = _dot(w, x, acc, HAS_SCALES, DOT_PREC, IMPRECISE_K)
        if SILU_MUL:
            u = tl.load(u_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if W_ONLY:
                u = u.to(tl.float16)
            acc_u = _dot(u, x, acc_u, HAS_SCALES, DOT_PREC, IMPRECISE_K)
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    _store_tile(acc, acc_u if SILU_MUL else acc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, amax_ptr, M, N,
                stride_o, pid_n, pid_s, offs_n, offs_m, n_mask, m_mask, HAS_BIAS, HAS_SCALES, W_ONLY, SILU_MUL, SPLIT,
                ROW_AMAX)


@triton.jit
def _skinny_gemm_tma_kernel(
    x_desc, x_scale_ptr, w_desc, w_scale_ptr, bias_ptr, out_ptr, part_ptr, amax_ptr,
    M, N, K, k_per_split, stride_o,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IMPRECISE_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    ROW_AMAX: tl.constexpr,
):
    """W8A8 as _skinny_gemm_kernel computes it, its K tiles brought into shared memory by the copy
    engine (TMA: one request a tile, no address arithmetic in the program's warps; rows past M and
    columns past K arrive as zeros)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PDL:
        wait_for_previous_kernel()
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SILU_MUL:
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([pid_n * BLOCK_N, k0])
        x = x_desc.load([pid_m * BLOCK_M, k0])
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=IMPRECISE_K)
        if SILU_MUL:  # up row N + n beside gate row n (a gate tile past N reads up rows: masked at the store)
            u = w_desc.load([N + pid_n * BLOCK_N, k0])
            acc_u = tl.dot(u, tl.trans(x), acc_u, max_num_imprecise_acc=IMPRECISE_K)
    _store_tile(acc, acc_u if SILU_MUL else acc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, amax_ptr, M, N,
                stride_o, pid_n, pid_s, offs_n, offs_m, offs_n < N, offs_m < M, HAS_BIAS, True, False, SILU_MUL, SPLIT,
                ROW_AMAX)


@triton.jit
def _store_tile(acc, acc_u, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr, amax_ptr, M, N, stride_o, pid_n,
                pid_s, offs_n, offs_m, n_mask, m_mask, HAS_BIAS: tl.constexpr, HAS_SCALES: tl.constexpr,
                W_ONLY: tl.constexpr, SILU_MUL: tl.constexpr, SPLIT: tl.constexpr, ROW_AMAX: tl.constexpr):
    """A program's [BLOCK_N, BLOCK_M] tile of out.T: float32 partials of its K split, or scaled,
    biased (SiLU-and-mul-ed with acc_u) and rounded into out. ROW_AMAX (SPLIT 1): also the largest
    |value| of each of its rows as stored, into amax_ptr[row, pid_n] (a [M, programs along N] array)."""
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT > 1:  # partials [SPLIT, M, N], float32, unscaled
        p_ptrs = part_ptr + (pid_s * M + offs_m.to(tl.int64))[None, :] * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=mask)
    else:
        y = acc
        if HAS_SCALES:
            y = y * tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
            y = y * tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
        if W_ONLY:
            y = y * (tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0) / W_ONLY_X_SCALE)[:, None]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        dt = out_ptr.dtype.element_ty
        if SILU_MUL:  # rounded as the unfused path rounds (kernels/activation.py)
            up = acc_u
            if HAS_SCALES:
                up = up * tl.load(w_scale_ptr + N + offs_n, mask=n_mask, other=0.0)[:, None]
                up = up * tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
            if W_ONLY:
                up = up * (tl.load(w_scale_ptr + N + offs_n, mask=n_mask, other=0.0) / W_ONLY_X_SCALE)[:, None]
            gate = y.to(dt).to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
        o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
        tl.store(o_ptrs, y.to(dt), mask=mask)
        if ROW_AMAX:
            stored = tl.where(mask, tl.abs(y.to(dt).to(tl.float32)), 0.0)
            tl.store(amax_ptr + offs_m.to(tl.int64) * tl.num_programs(0) + pid_n, tl.max(stored, 0), mask=m_mask)


@triton.jit
def _dot(w, x, acc, HAS_SCALES: tl.constexpr, DOT_PREC: tl.constexpr, IMPRECISE_K: tl.constexpr):
    """acc + w @ x.T on the tensor cores. Hopper's FP8 dot adds in reduced precision: its sums
    are promoted to float32 every IMPRECISE_K."""
    if HAS_SCALES:
        return tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=IMPRECISE_K)
    return tl.dot(w, tl.trans(x), acc, input_precision=DOT_PREC)


@triton.jit
def _skinny_gemm_reduce_kernel(
    part_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, stride_o,
    HAS_BIAS: tl.constexpr,
    HAS_W_SCALE: tl.constexpr,
    HAS_X_SCALE: tl.constexpr,
    W_ONLY: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_mask = offs_n < N
    if PDL:
        wait_for_previous_kernel()
    y = split_sum(part_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, m, M, N, offs_n, n_mask, HAS_BIAS, HAS_W_SCALE,
                  HAS_X_SCALE, W_ONLY, SPLIT)
    tl.store(out_ptr + m * stride_o + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def split_sum(part_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, m, M, N, offs_n, n_mask, HAS_BIAS: tl.constexpr,
              HAS_W_SCALE: tl.constexpr, HAS_X_SCALE: tl.constexpr, W_ONLY: tl.constexpr, SPLIT: tl.constexpr):
    """Row m's outputs offs_n of a split-K product (SplitPartials), float32 before the final
    rounding: the partials summed in a fixed order (the same sum on every run), scaled, biased.
    W_ONLY: the weight-only FP8 product, whose x was scaled by W_ONLY_X_SCALE."""
    acc = tl.zeros(offs_n.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + (s * M + m) * N + offs_n, mask=n_mask, other=0.0)
    y = acc
    if HAS_W_SCALE:
        if W_ONLY:
            y = y * (tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0) / W_ONLY_X_SCALE)
        else:
            y = y * tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    if HAS_X_SCALE:
        y = y * tl.load(x_scale_ptr + m)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    return y


class SplitPartials(NamedTuple):
    """A split-K product not summed yet (skinny_gemm(defer_reduce=True)): the float32 partials [SPLIT,
    M, N] and what the sum is then scaled by (weight_scale [N], x_scale [M]: None where not) and
    offset by (bias [N] or None) before it is rounded to dtype. The kernel that consumes the product
    (kernels/rmsnorm.py) finishes it as the reduce kernel would, bit for bit; finish_split() runs that
    reduce where a consumer cannot."""

    partials: torch.Tensor
    weight_scale: torch.Tensor | None
    x_scale: torch.Tensor | None
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.partials.device

    @property
    def is_cuda(self) -> bool:
        return self.partials.is_cuda


class SkinnyGemmTile(NamedTuple):
    """Weight rows and K elements per tile, rows of x per program, K splits, warps, pipeline stages."""

    block_n: int
    block_k: int
    block_m: int
    split: int
    num_warps: int
    num_stages: int


# shared memory the pipeline stages may take (an H200 SM has 227 KB; the compiler adds a little)
SHARED_MEMORY_BUDGET = 200 * 1024


def stage_bytes(tile: SkinnyGemmTile, weight_bytes: int, silu_mul: bool = False, x_bytes: int | None = None) -> int:
    """Shared memory of one pipeline stage: the weight tile(s) and the rows' K tile (x_bytes:
    its element size, default the weights')."""
    x_bytes = weight_bytes if x_bytes is None else x_bytes
    return (2 if silu_mul else 1) * tile.block_n * tile.block_k * weight_bytes + tile.block_m * tile.block_k * x_bytes


# W8A8 (FP8 x and weights) without SiLU-and-mul: 128-byte K tiles 8 stages deep instead of 256 x 5.
# H200, Llama-3.1-8B at 64 rows (skinny_gemm_bench.py --deep, skinny_gemm_bench-h200-llama-3.1-8b-
# fp8-deep-2026-12-02.json and ...-fp8-mlp-deep-...): qkv 13.27 against 15.35 us, o_proj 10.59
# against 11.38, down_proj 26.32 against 28.13; gate_up's 128 x 3 stays the fastest. 8B FP8 decode,
# interleaved (decode_latency.py --skinny-w8a8-deep on|off): batch 64 16,310 / 16,289 against 15,879 /
# 15,776 tok/s, batch 8 2,702 / 2,705 against 2,630 / 2,623 (decode_latency-h200-skinny-w8a8-deep-ab-
# 2026-12-02.json). bf16 weights gained nothing from deeper pipelines (qkv 16.89 against 16.95,
# o_proj 11.86 against 12.13).
W8A8_DEEP_PIPELINE = True
# W8A8 qkv / o_proj / down_proj at W8A8_TMA_MIN_ROWS rows or more go through _skinny_gemm_tma_kernel: the
# copy engine (TMA) brings the K tiles into shared memory, one request a tile. Nsight Compute on an H200
# (benchmarks/ncu_kernels.py, ncu-h200-skinny-gemv-2026-12-03.csv): the pointer kernel at 64 rows keeps one
# warp a scheduler issuing every 3.6 cycles, stalled on fixed-latency waits and barriers rather than memory
# (qkv 13.1 us at 41% of DRAM bandwidth). With TMA, Llama-3.1-8B at 64 rows (skinny_gemm_bench --w8a8-tma on,
# skinny_gemm_bench-h200-llama-3.1-8b-fp8-tma-sweep-2026-12-03.json; the default tiles stay the sweep's best):
# qkv 12.8 us, o_proj 10.3, down_proj 24.4, against 13.3 / 10.6 / 26.3 with pointers. 8B FP8 decode,
# interleaved on, off, on, off (8615439:benchmarks/results/decode_latency-h200-skinny-w8a8-tma-ab-2026-12-03.json): batch 64 16,605 /
# 16,636 against 16,360 / 16,350 tok/s; batch 8 2,629 / 2,631 against 2,657 / 2,658, hence rows past 32 only
# (from 33 rows the tiles are the 64-row ones).
W8A8_TMA_MIN_ROWS = 33
# The same for the fused [gate; up] projection with SiLU-and-mul, on top of the above: 8B FP8 batch 64 16,811
# against 16,640 tok/s, batch 1 353.3 against 355.6, one run each (decode_latency-h200-skinny-w8a8-tma-silu-ab-
# 2026-12-03.json; the device time allowed no second pair), hence also from 33 rows.
W8A8_TMA_SILU_MIN_ROWS = 33
# Measured slower and removed (the code is at 4cd2fa2): the TMA kernel with 8 warps a program (two warp
# groups, 32 of the 64 rows each), or its K loop warp-specialized by Triton 3.6 (a warp group issuing the
# loads, 12 warps). Llama-3.1-8B FP8 batch 64, interleaved (decode_latency-h200-skinny-w8a8-tma-warps-ab-
# 2026-12-03.json): 4 warps 16,642 / 16,561 tok/s, warp-specialized 13,623 / 13,510, 8 warps 16,068 / 15,971.
# The warp-specialized kernel also computed NaNs with SiLU-and-mul fused (gpu_tests-h200-2026-12-03-tma-warps.log).


def default_skinny_gemm_tile(m: int, n: int, k: int, num_sms: int, weight_bytes: int = 1,
                             silu_mul: bool = False, x_bytes: int | None = None) -> SkinnyGemmTile:
    """From benchmarks/skinny_gemm_bench.py --sweep on an H200 (Llama-3.1-8B projections, 8 and
    64 rows): 64 outputs a program, all rows (16 to 64) in one; 256-byte K tiles 5 stages deep, or
    128 bytes x 3 when the weight tiles already give every SM two programs (gate_up), or 128 x 8
    for W8A8 (W8A8_DEEP_PIPELINE); K split in two while that still fits the grid in one wave (o_proj
    and down_proj: 64 output tiles). Fewer stages where they would not fit in shared memory
    (SiLU-and-mul reads two weight tiles)."""
    block_n = 64
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    weight_tiles = tiles * (2 if silu_mul else 1)
    w8a8 = weight_bytes == 1 and x_bytes in (None, 1)
    if weight_tiles >= 2 * num_sms:
        tile_bytes, stages = 128, 3
    elif W8A8_DEEP_PIPELINE and w8a8 and not silu_mul:
        tile_bytes, stages = 128, 8
    else:
        tile_bytes, stages = 256, 5
    split = 1
    while not silu_mul and tiles * split * 2 <= num_sms and k // (split * 2) >= 1024:
        split *= 2
    tile = SkinnyGemmTile(block_n, tile_bytes // weight_bytes, block_m, split, 4, stages)
    while (tile.num_stages > 2
           and tile.num_stages * stage_bytes(tile, weight_bytes, silu_mul, x_bytes) > SHARED_MEMORY_BUDGET):
        tile = tile._replace(num_stages=tile.num_stages - 1)
    return tile


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    x_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    silu_mul: bool = False,
    defer_reduce: bool = False,
    tile: SkinnyGemmTile | None = None,
    row_amax: bool = False,
) -> torch.Tensor | SplitPartials | AmaxedRows:
    """x @ weight.T (+ bias) in float32, rounded to out_dtype (default x's dtype; bfloat16 for
    FP8 x): [M, N]. x [M, K] and weight [N, K] with contiguous rows, of one dtype, or (weight-only
    FP8) a float8 e4m3 weight with bf16 / fp16 x. FP8 weights need weight_scale float32 [N];
    FP8 x (W8A8) also x_scale float32 [M] (or [M, 1]): the product is then (x * x_scale) @
    (weight * weight_scale).T, and weight-only x @ (weight * weight_scale).T. silu_mul: weight is
    a fused [gate; up] of 2I rows (no bias) and the result silu(x @ gate.T) * (x @ up.T), [M, I];
    K is never split then. defer_reduce: a product whose K is split comes back as its SplitPartials,
    for the next kernel to sum (no reduce kernel; not weight-only FP8). tile overrides the launch
    shape (benchmark sweeps). row_amax (K not split): the result as AmaxedRows, with the largest |value|
    of each row's part that each program along N wrote, for the row quantization after it."""
    w_only = weight.dtype == FP8 and x.dtype in (torch.bfloat16, torch.float16)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or (x.dtype != weight.dtype and not w_only):
        raise ValueError(f"expected x [M, K] and weight [N, K] of one dtype (or an FP8 weight with bf16 / fp16 x), "
                         f"got {x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need contiguous rows")
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("silu_mul needs an even number of weight rows and no bias")
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    fp8 = x.dtype == FP8
    if fp8 or w_only:
        if weight_scale is None or (fp8 and x_scale is None) or (w_only and x_scale is not None):
            raise ValueError("an FP8 weight needs weight_scale, and FP8 x (only) x_scale")
        if weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32 \
                or not weight_scale.is_contiguous():
            raise ValueError(f"weight_scale must be float32 [{weight.shape[0]}], contiguous")
    if fp8:
        x_scale = x_scale.reshape(-1)
        if x_scale.shape != (m,) or x_scale.dtype != torch.float32 or not x_scale.is_contiguous():
            raise ValueError(f"x_scale must be float32 [{m}], contiguous")
    elif not w_only and (x_scale is not None or weight_scale is not None):
        raise ValueError("scales go with FP8 operands only")
    out = torch.empty((m, n), dtype=out_dtype or (torch.bfloat16 if fp8 else x.dtype), device=x.device)
    if m == 0:
        return out
    tile = tile or default_skinny_gemm_tile(m, n, k, sm_count(x.device), weight.element_size(), silu_mul,
                                            x.element_size())
    split = 1 if silu_mul else max(1, tile.split)
    # each split a whole number of K tiles
    k_per_split = triton.cdiv(triton.cdiv(k, split), tile.block_k) * tile.block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    row_amax = row_amax and split == 1
    amax = torch.empty((m, triton.cdiv(n, tile.block_n)), dtype=torch.float32, device=x.device) if row_amax else part
    pdl = use_pdl(x.device)
    scale_args = (x_scale if fp8 else out, weight_scale if fp8 or w_only else out)
    bias_arg = bias if bias is not None else out
    grid = (triton.cdiv(n, tile.block_n), split, triton.cdiv(m, tile.block_m))
    tma_min_rows = W8A8_TMA_SILU_MIN_ROWS if silu_mul else W8A8_TMA_MIN_ROWS
    if fp8 and 0 < tma_min_rows <= m and _tma_ready(x, weight):
        _skinny_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [tile.block_m, tile.block_k]), x_scale,
            TensorDescriptor.from_tensor(weight, [tile.block_n, tile.block_k]), weight_scale, bias_arg, out, part,
            amax, m, n, k, k_per_split, out.stride(0),
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, SPLIT=split, PDL=pdl, BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, IMPRECISE_K=min(128, tile.block_k),
            NUM_STAGES=tile.num_stages, ROW_AMAX=row_amax, num_warps=tile.num_warps, launch_pdl=pdl)
    else:
        _skinny_gemm_kernel[grid](
            x, scale_args[0], weight, scale_args[1], bias_arg, out, part, amax,
            m, n, k, k_per_split,
            x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None,
            HAS_SCALES=fp8,
            W_ONLY=w_only,
            SILU_MUL=silu_mul,
            SPLIT=split,
            PDL=pdl,
            DOT_PREC=dot_precision(x.dtype),
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            IMPRECISE_K=min(128, tile.block_k),  # as DeepSeek-V3 does (and cuBLAS without fast accumulation)
            ROW_AMAX=row_amax,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
            launch_pdl=pdl,
        )
    if split == 1:
        return AmaxedRows(out, amax) if row_amax else out
    pending = SplitPartials(part, weight_scale if fp8 or w_only else None, x_scale if fp8 else None, bias, out.dtype)
    if defer_reduce and not w_only:
        return pending
    return finish_split(pending, out, w_only)


def _tma_ready(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the copy engine can address x and weight: 16-byte aligned, rows 16-byte multiples apart."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, weight))


def finish_split(pending: SplitPartials, out: torch.Tensor | None = None, w_only: bool = False) -> torch.Tensor:
    """The product a SplitPartials stands for, [M, N] in its dtype (into `out` if given): the
    partials summed in split order, scaled, offset by the bias and rounded (w_only: of a weight-only
    FP8 product, skinny_gemm's own)."""
    split, m, n = pending.partials.shape
    out = torch.empty((m, n), dtype=pending.dtype, device=pending.partials.device) if out is None else out
    if m == 0:
        return out
    pdl = use_pdl(out.device)
    block = min(1024, triton.next_power_of_2(n))
    _skinny_gemm_reduce_kernel[(m, triton.cdiv(n, block))](
        pending.partials, pending.x_scale if pending.x_scale is not None else out,
        pending.weight_scale if pending.weight_scale is not None else out,
        pending.bias if pending.bias is not None else out, out,
        m, n, out.stride(0),
        HAS_BIAS=pending.bias is not None,
        HAS_W_SCALE=pending.weight_scale is not None,
        HAS_X_SCALE=pending.x_scale is not None,
        W_ONLY=w_only,
        SPLIT=split,
        PDL=pdl,
        BLOCK=block,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    x_scale: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, silu_mul: bool = False) -> torch.Tensor:
    """float32 reference: the (dequantized) operands' product (+ bias), rounded to out_dtype;
    silu_mul: then silu(gate) * up as kernels/activation.py rounds it."""
    xf, wf = x.float(), weight.float()
    if x_scale is not None:
        xf = xf * x_scale.reshape(-1, 1).float()
    if weight_scale is not None:
        wf = wf * weight_scale.float()[:, None]
    y = xf @ wf.T
    if bias is not None:
        y = y + bias.float()
    dtype = out_dtype or (torch.bfloat16 if x.dtype == FP8 else x.dtype)
    if silu_mul:
        gate, up = y.to(dtype).float().chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate).to(dtype).float() * up
    return y.to(dtype)
