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
  order (so results never depend on timing), then scales, adds the bias and rounds;
- the K loop is software-pipelined through shared memory (num_stages).

Launch parameters depend on shapes only (CUDA-graph capturable). skinny_gemm_ref is the float32
reference (for FP8, engine/models/fp8.py's fp8_linear_ref computes the same).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._common import dot_precision, rope_store_shapes, sm_count, use_pdl
from kernels._prefetch import prefetch_l2
from kernels.gemv import _rope_store_epilogue

FP8 = torch.float8_e4m3fn
# With PDL, each program asks L2 for the first weight tiles its pipeline will load (prefetch.global.L2:
# no registers, no wait) before it waits for the kernel before it, as the GEMV loads its first tile
# early. Off: no faster on the H200, 2026-12-02 (decode_latency.py --skinny-prefetch on|off, interleaved):
# Qwen2.5-0.5B batch 8 10,105 / 10,119 vs 10,268 / 10,256 tok/s, batch 64 59,487 / 59,934 vs 59,965 /
# 60,115. The GPU tests pass with it on.
PREFETCH_BEFORE_WAIT = False
# weight-only FP8: x * 2^-8 in fp16 overflows only past 16.7M, and loses bits only below 2^-16
# (absolute error < 2^-17 there), far finer than x's own bf16 rounding; the result is scaled back
W_ONLY_X_SCALE = tl.constexpr(2.0**-8)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr,
    pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    M, N, K, k_per_split,
    stride_x, stride_w, stride_o, stride_cs,
    HAS_BIAS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    W_ONLY: tl.constexpr,
    SILU_MUL: tl.constexpr,
    ROPE_STORE: tl.constexpr,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IMPRECISE_K: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
):
    """PREFETCH_LINES: 128-byte lines of each weight row to prefetch into L2 before the PDL wait (0: none).
    Paired modes read two weight rows per output: SILU_MUL gate row n and up row N + n; ROPE_STORE (a
    fused [q; k; v] weight, N row pairs) rows d and d + HALF of a head, whose outputs rotary mixes."""
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
    if ROPE_STORE:  # pair n: rows d and d + HALF of head n // HALF, d = n % HALF
        rows_a = (offs_n // HALF) * (2 * HALF) + offs_n % HALF
    else:
        rows_a = offs_n
    w_ptrs = w_ptr + rows_a.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    if SILU_MUL:
        u_ptrs = w_ptrs + N * stride_w
    if ROPE_STORE:
        u_ptrs = w_ptrs + HALF * stride_w
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    if PREFETCH_LINES > 0:  # the weights do not depend on the kernel before: ask for them first
        rows = tl.where(n_mask, rows_a, 0)
        _prefetch_l2(w_ptr, rows, stride_w, k_start, k_end, PREFETCH_LINES)
        if SILU_MUL:
            _prefetch_l2(w_ptr, rows + N, stride_w, k_start, k_end, PREFETCH_LINES)
        if ROPE_STORE:
            _prefetch_l2(w_ptr, rows + HALF, stride_w, k_start, k_end, PREFETCH_LINES)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SILU_MUL or ROPE_STORE:
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + tl.arange(0, BLOCK_K)) < k_end
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if W_ONLY:  # e4m3 weights are exact in fp16; x scaled into fp16's range (see W_ONLY_X_SCALE)
            x = (x.to(tl.float32) * W_ONLY_X_SCALE).to(tl.float16)
            w = w.to(tl.float16)
        acc = _dot(w, x, acc, HAS_SCALES, DOT_PREC, IMPRECISE_K)
        if SILU_MUL or ROPE_STORE:
            u = tl.load(u_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if W_ONLY:
                u = u.to(tl.float16)
            acc_u = _dot(u, x, acc_u, HAS_SCALES, DOT_PREC, IMPRECISE_K)
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT > 1:  # partials [SPLIT, M, N], float32, unscaled
        p_ptrs = part_ptr + (pid_s * M + offs_m.to(tl.int64))[None, :] * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=mask)
    else:
        dt = out_ptr.dtype.element_ty
        y = _dequantized(acc, rows_a, offs_m, n_mask, m_mask, x_scale_ptr, w_scale_ptr, HAS_SCALES, W_ONLY)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows_a, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if ROPE_STORE:  # rounded as the projection's output, then rotated and stored as kernels.gemv does
            y_b = _dequantized(acc_u, rows_a + HALF, offs_m, n_mask, m_mask, x_scale_ptr, w_scale_ptr, HAS_SCALES,
                               W_ONLY)
            if HAS_BIAS:
                y_b += tl.load(bias_ptr + rows_a + HALF, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tokens = tl.minimum(offs_m, M - 1).to(tl.int64)[None, :]  # padding rows load row M - 1, store nothing
            _rope_store_epilogue(y.to(dt).to(tl.float32), y_b.to(dt).to(tl.float32), rows_a[:, None],
                                 (rows_a + HALF)[:, None], (offs_n % HALF)[:, None], mask, tokens,
                                 out_ptr + offs_m.to(tl.int64)[None, :] * stride_o, pos_ptr, cos_sin_ptr, stride_cs,
                                 slot_ptr, k_cache_ptr, v_cache_ptr, Q_SIZE, KV_SIZE, HALF)
        else:
            if SILU_MUL:  # rounded as the unfused path rounds (kernels/activation.py)
                up = _dequantized(acc_u, N + offs_n, offs_m, n_mask, m_mask, x_scale_ptr, w_scale_ptr, HAS_SCALES,
                                  W_ONLY)
                gate = y.to(dt).to(tl.float32)
                y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
            o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
            tl.store(o_ptrs, y.to(dt), mask=mask)


@triton.jit
def _dequantized(acc, rows, offs_m, n_mask, m_mask, x_scale_ptr, w_scale_ptr, HAS_SCALES: tl.constexpr,
                 W_ONLY: tl.constexpr):
    """acc [rows, tokens] times the FP8 scales of its weight rows (and, W8A8, of its tokens)."""
    if HAS_SCALES:
        acc = acc * tl.load(w_scale_ptr + rows, mask=n_mask, other=0.0)[:, None]
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    if W_ONLY:
        acc = acc * (tl.load(w_scale_ptr + rows, mask=n_mask, other=0.0) / W_ONLY_X_SCALE)[:, None]
    return acc


@triton.jit
def _prefetch_l2(w_ptr, rows, stride_w, k_start, k_end, LINES: tl.constexpr):
    """Ask L2 for the first LINES 128-byte lines of each row's weights from k_start (addresses clamped
    to the rows' last element)."""
    per_line = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements in 128 bytes
    offs = tl.minimum(k_start + tl.arange(0, LINES) * per_line, k_end - 1)
    prefetch_l2(w_ptr + rows.to(tl.int64)[:, None] * stride_w + offs[None, :])


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
    HAS_SCALES: tl.constexpr,
    W_ONLY: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_mask = offs_n < N
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: the same sum on every run
        acc += tl.load(part_ptr + (s * M + m) * N + offs_n, mask=n_mask, other=0.0)
    y = acc
    if HAS_SCALES:
        y = y * tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0) * tl.load(x_scale_ptr + m)
    if W_ONLY:
        y = y * (tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0) / W_ONLY_X_SCALE)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_o + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


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


def default_skinny_gemm_tile(m: int, n: int, k: int, num_sms: int, weight_bytes: int = 1,
                             silu_mul: bool = False, x_bytes: int | None = None) -> SkinnyGemmTile:
    """From benchmarks/skinny_gemm_bench.py --sweep on an H200 (Llama-3.1-8B projections, 8 and
    64 rows): 64 outputs a program, all rows (16 to 64) in one; 256-byte K tiles 5 stages deep, or
    128 bytes x 3 when the weight tiles already give every SM two programs (gate_up); K split in
    two while that still fits the grid in one wave (o_proj and down_proj: 64 output tiles). Fewer
    stages where they would not fit in shared memory (SiLU-and-mul reads two weight tiles)."""
    block_n = 64
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    weight_tiles = tiles * (2 if silu_mul else 1)
    tile_bytes, stages = (128, 3) if weight_tiles >= 2 * num_sms else (256, 5)
    split = 1
    while not silu_mul and tiles * split * 2 <= num_sms and k // (split * 2) >= 1024:
        split *= 2
    tile = SkinnyGemmTile(block_n, tile_bytes // weight_bytes, block_m, split, 4, stages)
    while (tile.num_stages > 2
           and tile.num_stages * stage_bytes(tile, weight_bytes, silu_mul, x_bytes) > SHARED_MEMORY_BUDGET):
        tile = tile._replace(num_stages=tile.num_stages - 1)
    return tile


def _check_operands(x: torch.Tensor, weight: torch.Tensor, x_scale: torch.Tensor | None,
                    weight_scale: torch.Tensor | None) -> tuple[bool, bool, torch.Tensor | None]:
    """(W8A8, weight-only FP8, x_scale as [M]) after checking the operands."""
    w_only = weight.dtype == FP8 and x.dtype in (torch.bfloat16, torch.float16)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or (x.dtype != weight.dtype and not w_only):
        raise ValueError(f"expected x [M, K] and weight [N, K] of one dtype (or an FP8 weight with bf16 / fp16 x), "
                         f"got {x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need contiguous rows")
    fp8 = x.dtype == FP8
    if fp8 or w_only:
        if weight_scale is None or (fp8 and x_scale is None) or (w_only and x_scale is not None):
            raise ValueError("an FP8 weight needs weight_scale, and FP8 x (only) x_scale")
        if weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32 \
                or not weight_scale.is_contiguous():
            raise ValueError(f"weight_scale must be float32 [{weight.shape[0]}], contiguous")
    if fp8:
        x_scale = x_scale.reshape(-1)
        if x_scale.shape != (x.shape[0],) or x_scale.dtype != torch.float32 or not x_scale.is_contiguous():
            raise ValueError(f"x_scale must be float32 [{x.shape[0]}], contiguous")
    elif not w_only and (x_scale is not None or weight_scale is not None):
        raise ValueError("scales go with FP8 operands only")
    return fp8, w_only, x_scale


def _launch(x, weight, bias, x_scale, weight_scale, out, n, tile, fp8, w_only, silu_mul=False, rope=None) -> None:
    """rope: (positions, cos_sin, slot_mapping, k_cache, v_cache, q_size, kv_size, head_dim) or None;
    silu_mul and rope read weight rows in pairs and never split K."""
    m, k = x.shape
    split = 1 if silu_mul or rope else max(1, tile.split)
    # each split a whole number of K tiles
    k_per_split = triton.cdiv(triton.cdiv(k, split), tile.block_k) * tile.block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    pdl = use_pdl(x.device)
    # the lines of the tiles the pipeline's prologue loads (num_stages - 1 of them), a power of two
    prologue_lines = (tile.num_stages - 1) * tile.block_k * weight.element_size() // 128
    prefetch_lines = 1 << (prologue_lines.bit_length() - 1) if pdl and PREFETCH_BEFORE_WAIT and prologue_lines else 0
    scale_args = (x_scale if fp8 else out, weight_scale if fp8 or w_only else out)
    bias_arg = bias if bias is not None else out
    positions, cos_sin, slots, k_cache, v_cache, q_size, kv_size, head_dim = rope or (out, out, out, out, out, 0, 0, 2)
    _skinny_gemm_kernel[(triton.cdiv(n, tile.block_n), split, triton.cdiv(m, tile.block_m))](
        x, scale_args[0], weight, scale_args[1], bias_arg, out, part,
        positions, cos_sin, slots, k_cache, v_cache,
        m, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0), cos_sin.stride(0) if rope else 0,
        HAS_BIAS=bias is not None,
        HAS_SCALES=fp8,
        W_ONLY=w_only,
        SILU_MUL=silu_mul,
        ROPE_STORE=rope is not None,
        Q_SIZE=q_size,
        KV_SIZE=kv_size,
        HALF=head_dim // 2,
        SPLIT=split,
        PDL=pdl,
        DOT_PREC=dot_precision(x.dtype),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        IMPRECISE_K=min(128, tile.block_k),  # as DeepSeek-V3 does (and cuBLAS without fast accumulation)
        PREFETCH_LINES=prefetch_lines,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        launch_pdl=pdl,
    )
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _skinny_gemm_reduce_kernel[(m, triton.cdiv(n, block))](
            part, scale_args[0], scale_args[1], bias_arg, out,
            m, n, out.stride(0),
            HAS_BIAS=bias is not None,
            HAS_SCALES=fp8,
            W_ONLY=w_only,
            SPLIT=split,
            PDL=pdl,
            BLOCK=block,
            num_warps=4,
            launch_pdl=pdl,
        )


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    x_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    silu_mul: bool = False,
    tile: SkinnyGemmTile | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32, rounded to out_dtype (default x's dtype; bfloat16 for
    FP8 x): [M, N]. x [M, K] and weight [N, K] with contiguous rows, of one dtype, or (weight-only
    FP8) a float8 e4m3 weight with bf16 / fp16 x. FP8 weights need weight_scale float32 [N];
    FP8 x (W8A8) also x_scale float32 [M] (or [M, 1]): the product is then (x * x_scale) @
    (weight * weight_scale).T, and weight-only x @ (weight * weight_scale).T. silu_mul: weight is
    a fused [gate; up] of 2I rows (no bias) and the result silu(x @ gate.T) * (x @ up.T), [M, I];
    K is never split then. tile overrides the launch shape (benchmark sweeps)."""
    fp8, w_only, x_scale = _check_operands(x, weight, x_scale, weight_scale)
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("silu_mul needs an even number of weight rows and no bias")
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or (torch.bfloat16 if fp8 else x.dtype), device=x.device)
    if m == 0:
        return out
    tile = tile or default_skinny_gemm_tile(m, n, k, sm_count(x.device), weight.element_size(), silu_mul,
                                            x.element_size())
    _launch(x, weight, bias, x_scale, weight_scale, out, n, tile, fp8, w_only, silu_mul=silu_mul)
    return out


def skinny_gemm_rope_store(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    *,
    x_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    tile: SkinnyGemmTile | None = None,
) -> torch.Tensor:
    """The input side of decode attention in one kernel for 2 to ~64 rows, as kernels.gemv's
    gemv_rope_store is for one: qkv = x @ weight.T (+ bias) for a fused [q; k; v] weight (operands
    as skinny_gemm takes them), rotary of q and k at `positions`, rotated k and v written into the
    paged caches at slot_mapping [M] (-1: skipped). Returns the rotated q [M, Hq, D] in out_dtype
    (x's dtype unless x is FP8). Equals skinny_gemm + kernels.rope_kv_store.rope_and_store_kv."""
    fp8, w_only, x_scale = _check_operands(x, weight, x_scale, weight_scale)
    q_size, kv_size, head_dim = rope_store_shapes(x, weight, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
                                                  num_heads)
    m, k = x.shape
    out_dtype = x.dtype if not fp8 else out_dtype
    q = torch.empty((m, num_heads, head_dim), dtype=out_dtype, device=x.device)
    if m == 0:
        return q
    pairs = weight.shape[0] // 2
    tile = tile or default_skinny_gemm_tile(m, pairs, k, sm_count(x.device), weight.element_size(), True,
                                            x.element_size())
    rope = (positions, cos_sin_cache, slot_mapping, k_cache, v_cache, q_size, kv_size, head_dim)
    _launch(x, weight, bias, x_scale, weight_scale, q.view(m, q_size), pairs, tile, fp8, w_only, rope=rope)
    return q


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
