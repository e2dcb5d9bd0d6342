"""Matrix-vector products for decode-sized batches: out = x @ W.T for x [M, K] with few rows.

At batch 1 a decoder layer's projections are memory-bound matrix-vector products over a few MB
of weights each; cuBLAS picks split-K GEMM tiles for them (a GEMM plus a reduce kernel, ~40% of
bandwidth on an H200 for Qwen2.5-0.5B). Here one program computes BLOCK_N outputs of one row
over the whole K (W is row-major [N, K], so each output's weights are contiguous), and fuses
what sits around the projection in the decoder:

- prologue: RMSNorm of x (optionally of x + residual, writing the new residual): the norm kernel
  between projections disappears; every program recomputes the row's mean square (K values, from L2);
- epilogue: bias; SiLU-and-mul for a fused [gate; up] weight (each program reads the matching
  gate and up rows, so the [M, 2I] intermediate is never written); output dtype (float32 logits);
  or, for a fused [q; k; v] projection, rotary embedding of q and k and the KV-cache write (each
  program takes pairs of rows d and d + D/2 of a head, the two halves rotary mixes), so a decode
  step's attention input side is one kernel and only the rotated q is written out.

Rounding follows the unfused path step by step (residual, normalised value, weighted value and the
projection's output are each rounded to the model dtype), so fused and unfused agree to within the
summation order of the dot product. Launch parameters depend on shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphserve.kernels.arg_checks import rope_store_shapes
from graphserve.kernels.launch_settings import sm_count, use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel


# K compiled into the kernel (one variant a model width) instead of a run-time argument: loops of one
# trip vanish and ptxas may schedule loads across the unrolled ones (sm_90 SASS of Qwen2.5-0.5B's qkv
# GEMV: 744 instructions against 1,208). Off: per projection on an H200 (8615439:benchmarks/results/gemv_bench-h200-ahead-*-2026-12-03.json)
# it gained ~0.9 us each on Llama-3.1-8B's K = 4096 bf16 projections (qkv 14.38 against 15.30, o 8.79 / 9.64,
# gate_up 57.61 / 58.98) but lost 2.6 on down_proj (K = 14336: 33.18 / 30.56) and was mixed on the 0.5B and
# FP8; in decode, on everywhere measured 0.5B 1,863-1,870 against 1,857-1,867 tok/s, 8B bf16 239.3 against
# 240.5, FP8 357.3 against 361 (8615439:benchmarks/results/decode_latency-h200-gemv-ahead-ab-2026-12-03.json). To measure next: on for
# K <= 4096 only: K_CONSTEXPR_MAX_K = 4096 (0: never; decode_latency.py --gemv-k-constexpr-max-k,
# gemv_bench.py --k-constexpr-max-k).
K_CONSTEXPR_MAX_K = 0
# FP8 weights arrive as int8 bytes. The hardware path from e4m3 to float32 (two conversions per
# weight, on the GPU's slow conversion pipe) capped the kernel at ~40% of bandwidth on an H200;
# instead the byte's sign goes to bit 31 and its exponent and mantissa to bits 20-26 of a float32,
# two integer operations: exactly q * 2^-120, subnormals included (e4m3 subnormals become float32
# subnormals). The inputs are scaled by 2^64 and the sums by 2^56 to keep every product well
# inside float32's normal range; powers of two, so the products equal q * x exactly as before.
_X_PRESCALE = tl.constexpr(2.0**64)
_Y_RESCALE = tl.constexpr(2.0**56)
# Measured slower and removed (the code is at 279634c, kernels/gemv.WEIGHT_TILES_AHEAD, INPUT_TILE_AHEAD,
# NORM_ONE_PASS): the weights two K tiles ahead of their use instead of one, each input tile (x, residual,
# norm weight) loaded an iteration ahead, the fused norm's row read in one load. Per projection at one row
# (8615439:benchmarks/results/gemv_bench-h200-ahead-*-2026-12-03.json) two tiles ahead lost everywhere (8B FP8 o 9.95 against 6.73 us,
# 0.5B gate_up 9.75 / 6.16, 8B bf16 gate_up 71.9 / 59.0); the other two moved nothing past 0.5 us. All three
# with K compiled in, batch-1 decode interleaved (8615439:benchmarks/results/decode_latency-h200-gemv-ahead-ab-2026-12-03.json): 0.5B
# 1,709-1,721 against 1,857-1,867 tok/s, 8B bf16 209.3 against 240.5, FP8 340.6 against 361.
# Nsight Compute (ncu-h200-skinny-gemv-2026-12-03.json): the FP8 GEMVs issue an instruction on 51-62% of
# scheduler cycles at 24% occupancy, so more weight bytes in flight a program (registers) trades against
# the instruction issue that already half-limits them.
# Measured and removed (the code is at 9ba458b): the FP8 one-row o_proj and down_proj with products and
# running sums in packed bf16 pairs (weights read as words of four, one prmt, one mask and two
# multiply-adds a pair, fma.rn.bf16x2): 37% fewer loop instructions and 80 registers against 126, yet
# Llama-3.1-8B o 6.49 against 6.82 us, down 19.97 against 19.08, FP8 batch 1 359.0-359.3 against
# 358.8-359.2 tok/s (8615439:benchmarks/results/decode_latency-h200-fp8-gemv-pairs-ab-2026-12-02.json): the float32 path is not
# bound by its integer work.
# Measured slower and removed (the code is at fe79b3e): asking L2 (prefetch.global.L2) for the weight
# tile 2 or 4 K tiles ahead of the one loaded into registers. H200, one row, 0 / 2 / 4 ahead
# (8615439:benchmarks/results/gemv_bench-h200-l2-prefetch-ahead-2026-12-02.json): Llama-3.1-8B bf16 down_proj 30.3 / 80.3 / 82.1
# us, FP8 gate_up 44.8 / 55.8 / 59.2; batch-1 decode Qwen2.5-0.5B 1,829-1,834 / 1,453-1,459 /
# 1,426-1,429 tok/s, 8B bf16 247.2-247.6 / - / 142.0, FP8 359.3-359.6 / - / 320.5-320.7
# (8615439:benchmarks/results/decode_latency-h200-gemv-l2-prefetch-ab-2026-12-02.json). A likely cause, not verified: a tile of
# BLOCK_N x (lines a row) addresses is spread over every thread of the program, so most lines are
# requested several times (16 times for down_proj's 1 x 1024 tile on 8 warps).
# Measured and removed (the code is at 7995493): the fused RMSNorm's squares summed in the K loop, over the
# input tiles the loop reads anyway, and 1 / rms applied to the dot products at the end (no pass over the row
# before the loop; the normalised input left in float32). Batch 1, interleaved
# (8615439:benchmarks/results/decode_latency-h200-gemv-norm-in-loop-ab-2026-12-03.json): Qwen2.5-0.5B 1,853-1,859 against 1,829-1,838
# tok/s, but Llama-3.1-8B bf16 233.9-234.3 against 248.0-248.2, FP8 within noise.
# Measured slower and removed (the code is at f7cdaff, kernels/gemv.THREAD_SUM_BYTES): the K loop summing each
# run of 16 weight bytes a row into one partial as it goes (tl.reshape + tl.sum) instead of a float32 accumulator
# a weight. Fewer registers on sm_90 (FP8 o / down / qkv 79 / 64 / 92 against 125 / 126 / 166) but ~50% more
# instructions in the loop (FP8 o_proj: 507 against 340, byte permutes and integer moves). Batch 1, interleaved
# (8615439:benchmarks/results/decode_latency-h200-gemv-thread-sum-ab-2026-12-03.json): Qwen2.5-0.5B 1,742-1,751 against 1,825-1,831 tok/s,
# Llama-3.1-8B bf16 232.5-232.9 against 241.9-242.6, FP8 318.0-318.7 against 355.2-355.7.
# Also measured and removed (the code is at ceabb1e): the K loop software-pipelined 4 stages deep through
# shared memory (Triton's cp.async, after the PDL wait) instead of the next tile in registers loaded
# before it. One row (8615439:benchmarks/results/gemv_bench-h200-pipelined-stages-2026-12-02.json): FP8 qkv 14.05 against 11.83
# us, o_proj 7.14 against 6.83, down_proj 18.90 against 18.94; Qwen2.5-0.5B bf16 qkv 3.10 against
# 2.39, down_proj 6.01 against 3.63. Batch-1 decode, one run each
# (8615439:benchmarks/results/decode_latency-h200-gemv-stages-ab-2026-12-02.json): 0.5B 1,442 against 1,822-1,830 tok/s; 8B FP8
# 363.0-363.5 against 359.4-359.7, a gain the per-projection times do not explain.


@triton.jit
def _weight_f32(w, FP8_BYTES: tl.constexpr):
    """A weight tile in float32: bf16/fp16/fp32 converted, FP8 (int8 bytes) as q * 2^-120."""
    if FP8_BYTES:
        bits = (w.to(tl.int32) << 20) & -2013265921  # 0x87FFFFFF: the sign and bits 20-26
        return bits.to(tl.float32, bitcast=True)
    return w.to(tl.float32)


@triton.jit
def _x_tile(x_row, r_row, res_out_row, norm_w_ptr, offs_k, k_mask, inv_rms, res_store_end,
            HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One K tile of the projection's input in float32: x, or the RMSNorm of x (+ residual, whose
    new value the row's first program stores), rounded as the unfused decoder rounds."""
    dt = x_row.dtype.element_ty
    xk = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        if HAS_RESIDUAL:
            h = (xk + tl.load(r_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)).to(dt)
            tl.store(res_out_row + offs_k, h, mask=offs_k < res_store_end)
            xk = h.to(tl.float32)
        g = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        xk = ((xk * inv_rms).to(dt).to(tl.float32) * g).to(dt).to(tl.float32)
    return xk


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    N, K, eps,
    stride_x, stride_r, stride_ro, stride_w, stride_o, stride_cs,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_W_SCALE: tl.constexpr,
    SILU_MUL: tl.constexpr,
    ROPE_STORE: tl.constexpr,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr,
    K_CONST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """N: outputs (SiLU-and-mul: gate rows; rotary: row pairs). Paired modes read two row sets.
    HAS_W_SCALE: FP8 weights, each row's dot product times its scale."""
    if K_CONST:  # K known at compile time: loops of one trip vanish and loads can move ahead
        K = K_CONST
    m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    x_row = x_ptr + m * stride_x
    r_row = res_ptr + m * stride_r
    res_out_row = res_out_ptr + m * stride_ro
    if ROPE_STORE:  # pair p: rows d and d + HALF of head p // HALF, d = p % HALF
        rows_a = (offs_n // HALF) * (2 * HALF) + offs_n % HALF
        rows_b = rows_a + HALF
    elif SILU_MUL:  # gate row n and up row N + n
        rows_a = offs_n
        rows_b = offs_n + N
    else:
        rows_a = offs_n
    w_rows = w_ptr + rows_a.to(tl.int64)[:, None] * stride_w
    if SILU_MUL or ROPE_STORE:
        b_rows = w_ptr + rows_b.to(tl.int64)[:, None] * stride_w

    # The weights do not depend on the kernels before this one: the first K tile is read before
    # waiting for them (PDL), and every later tile one iteration ahead of its use.
    offs_k = tl.arange(0, BLOCK_K)
    wk_mask = n_mask[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=wk_mask, other=0.0)
    if SILU_MUL or ROPE_STORE:
        u = tl.load(b_rows + offs_k[None, :], mask=wk_mask, other=0.0)
    if PDL:
        wait_for_previous_kernel()

    inv_rms = 1.0
    if HAS_NORM:
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            h = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h = (h + tl.load(r_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
            sq += h * h
        inv_rms = tl.rsqrt(tl.sum(sq, 0) / K + eps)

    # one program per row writes the new residual (the others only read the old one)
    res_store_end = tl.where(pid_n == 0, K, 0)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if SILU_MUL or ROPE_STORE:
        acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xk = _x_tile(x_row, r_row, res_out_row, norm_w_ptr, offs_k, offs_k < K, inv_rms, res_store_end,
                     HAS_NORM, HAS_RESIDUAL)
        if HAS_W_SCALE:
            xk = xk * _X_PRESCALE
        acc += _weight_f32(w, HAS_W_SCALE) * xk[None, :]
        if SILU_MUL or ROPE_STORE:
            acc_b += _weight_f32(u, HAS_W_SCALE) * xk[None, :]
        next_k = offs_k + BLOCK_K
        wk_mask = n_mask[:, None] & (next_k < K)[None, :]
        w = tl.load(w_rows + next_k[None, :], mask=wk_mask, other=0.0)
        if SILU_MUL or ROPE_STORE:
            u = tl.load(b_rows + next_k[None, :], mask=wk_mask, other=0.0)

    y = tl.sum(acc, 1)
    if HAS_W_SCALE:
        y *= tl.load(w_scale_ptr + rows_a, mask=n_mask, other=0.0) * _Y_RESCALE
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows_a, mask=n_mask, other=0.0).to(tl.float32)
    if SILU_MUL or ROPE_STORE:
        y_b = tl.sum(acc_b, 1)
        if HAS_W_SCALE:
            y_b *= tl.load(w_scale_ptr + rows_b, mask=n_mask, other=0.0) * _Y_RESCALE
    if ROPE_STORE:
        if HAS_BIAS:
            y_b += tl.load(bias_ptr + rows_b, mask=n_mask, other=0.0).to(tl.float32)
        _rope_store_epilogue(y.to(dt).to(tl.float32), y_b.to(dt).to(tl.float32), rows_a, rows_b, offs_n % HALF,
                             n_mask, m, out_ptr + m * stride_o, pos_ptr, cos_sin_ptr, stride_cs, slot_ptr,
                             k_cache_ptr, v_cache_ptr, Q_SIZE, KV_SIZE, HALF)
    else:
        if SILU_MUL:
            gate = y.to(dt).to(tl.float32)
            up = y_b.to(dt).to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
        tl.store(out_ptr + m * stride_o + offs_n, y.to(dt).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _rope_store_epilogue(y_a, y_b, rows_a, rows_b, d, n_mask, m, q_out_row, pos_ptr, cos_sin_ptr, stride_cs,
                         slot_ptr, k_cache_ptr, v_cache_ptr,
                         Q_SIZE: tl.constexpr, KV_SIZE: tl.constexpr, HALF: tl.constexpr):
    """Rows a (first half of a head) and b (second half) of q, k or v, rounded to the model dtype:
    rotate q and k as kernels.rope_kv_store does, write q out and k, v into the cache slot."""
    dt = q_out_row.dtype.element_ty
    pos = tl.load(pos_ptr + m).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d).to(dt).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d).to(dt).to(tl.float32)
    is_v = rows_a >= Q_SIZE + KV_SIZE
    rot_a = tl.where(is_v, y_a, y_a * cos - y_b * sin).to(dt)
    rot_b = tl.where(is_v, y_b, y_b * cos + y_a * sin).to(dt)
    is_q = rows_a < Q_SIZE
    tl.store(q_out_row + rows_a, rot_a, mask=n_mask & is_q)
    tl.store(q_out_row + rows_b, rot_b, mask=n_mask & is_q)
    # slot broadcast to the tile first: a scalar-bool & tensor mask trips Triton's interpreter
    slots = tl.zeros_like(rows_a).to(tl.int64) + tl.load(slot_ptr + m).to(tl.int64)
    keep = n_mask & (slots >= 0)
    is_k = keep & (rows_a >= Q_SIZE) & (rows_a < Q_SIZE + KV_SIZE)
    in_kv_a = rows_a - Q_SIZE - tl.where(is_v, KV_SIZE, 0)  # (kv head, d) offset within a token's K or V
    in_kv_b = rows_b - Q_SIZE - tl.where(is_v, KV_SIZE, 0)
    cache_dt = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + slots * KV_SIZE + in_kv_a, rot_a.to(cache_dt), mask=is_k)
    tl.store(k_cache_ptr + slots * KV_SIZE + in_kv_b, rot_b.to(cache_dt), mask=is_k)
    tl.store(v_cache_ptr + slots * KV_SIZE + in_kv_a, rot_a.to(cache_dt), mask=keep & is_v)
    tl.store(v_cache_ptr + slots * KV_SIZE + in_kv_b, rot_b.to(cache_dt), mask=keep & is_v)


class GemvTile(NamedTuple):
    """Outputs (SiLU-and-mul: row pairs) and K elements per program, warps."""

    block_n: int
    block_k: int
    num_warps: int


# Tile choice from benchmarks/gemv_bench.py --sweep on an H200 with programmatic dependent launch
# (one row; Qwen2.5-0.5B and Llama-3.1-8B projections, bf16 and FP8; results in
# benchmarks/results/gemv_bench-*.json). 4 warps won nearly everywhere.
# - SiLU-and-mul: 8 gate/up row pairs with K tiles of 256 (512 for FP8: the same bytes); for bf16
#   with K >= 4096, 2 pairs with 1024-wide tiles (Llama-3.1-8B: 57.7 us, cuBLAS 60.5, 65.4 with the
#   short tiles).
# - A long K (down_proj): one bf16 row with 1024-wide tiles and 8 warps, or up to 4 FP8 rows with
#   2048-wide tiles.
# - Otherwise K tiles of up to 1024 (one or a few loop iterations) and at most 8 rows, few enough
#   to give every SM 2 programs.
_MAX_BLOCK_K = 1024
_LONG_K = 4096
_MAX_BLOCK_N = 8
# bf16 down_proj's K tile. Compiled for sm_90 a [1, 2048] tile takes 29 registers like the [1, 1024]
# one (8 programs an SM either way) while it keeps twice the weight bytes in flight. H200, 2026-12-02,
# interleaved (benchmarks/decode_latency.py --gemv-long-k-block 2048|1024, batch 1): Qwen2.5-0.5B
# 1,775-1,780 vs 1,787-1,793 tok/s; Llama-3.1-8B 243.5 / 243.7 vs 240.4 / 241.4, but with 2048 its
# teacher-forced argmax agreement with transformers fell under the GPU test's bar (0.8125 against
# 0.825; it passes at 1024), so 1024 stays until a larger-sample accuracy check says otherwise.
LONG_K_BLOCK_K = 1024


def default_gemv_tile(rows: int, n: int, k: int, num_sms: int, silu_mul: bool = False,
                      weight_bytes: int = 2) -> GemvTile:
    """weight_bytes: bytes per weight element (1: FP8)."""
    fp8 = weight_bytes == 1
    if silu_mul:
        if k >= _LONG_K and not fp8:
            return GemvTile(2, _MAX_BLOCK_K, 4)
        return GemvTile(8, min(512 if fp8 else 256, triton.next_power_of_2(k)), 4)
    if k > _LONG_K and not fp8:
        return GemvTile(1, LONG_K_BLOCK_K, 8)
    block_n, block_k = (4, 2048) if k > _LONG_K else (_MAX_BLOCK_N, min(_MAX_BLOCK_K, triton.next_power_of_2(k)))
    while block_n > 1 and rows * triton.cdiv(n, block_n) < 2 * num_sms:
        block_n //= 2
    return GemvTile(block_n, block_k, 4)


def _check_inputs(x, weight, norm_weight, residual) -> None:
    k = x.shape[-1]
    if x.dim() != 2 or x.stride(-1) != 1 or weight.dim() != 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"expected x [M, K] and weight [N, K] with contiguous rows, got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    if residual is not None and (norm_weight is None or residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError("residual needs norm_weight and the shape of x")
    if norm_weight is not None and (norm_weight.shape != (k,) or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight must be [{k}] and contiguous")


def _launch(x, weight, weight_scale, bias, norm_weight, residual, eps, out, n, tile, silu_mul=False,
            rope=None) -> torch.Tensor | None:
    """rope: (positions, cos_sin, slot_mapping, k_cache, v_cache, q_size, kv_size, head_dim) or None."""
    rows, k = x.shape
    new_residual = torch.empty_like(x) if residual is not None else None
    if rows == 0:
        return new_residual
    positions, cos_sin, slots, k_cache, v_cache, q_size, kv_size, head_dim = rope or (x, x, x, x, x, 0, 0, 2)
    pdl = use_pdl(x.device)
    _gemv_kernel[(rows, triton.cdiv(n, tile.block_n))](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        new_residual if new_residual is not None else out,
        weight.view(torch.int8) if weight_scale is not None else weight,
        weight_scale if weight_scale is not None else out, bias if bias is not None else weight, out,
        positions, cos_sin, slots, k_cache, v_cache,
        n, k, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        new_residual.stride(0) if new_residual is not None else 0, weight.stride(0), out.stride(0),
        cos_sin.stride(0) if rope else 0,
        HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        HAS_W_SCALE=weight_scale is not None,
        SILU_MUL=silu_mul,
        ROPE_STORE=rope is not None,
        Q_SIZE=q_size,
        KV_SIZE=kv_size,
        HALF=head_dim // 2,
        PDL=pdl,
        K_CONST=k if k <= K_CONSTEXPR_MAX_K else 0,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        launch_pdl=pdl,
    )
    return new_residual


def _check_scale(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    if weight_scale is not None and (weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32
                                     or not weight_scale.is_contiguous()):
        raise ValueError(f"weight_scale must be float32 [{weight.shape[0]}] and contiguous (one scale per weight row)")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
    tile: GemvTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out = f(x) @ weight.T (+ bias), for x [M, K] (rows may be strided, last dim contiguous),
    weight [N, K] (contiguous rows).

    norm_weight: f(x) = rms_norm(x) * norm_weight, or rms_norm(x + residual) * norm_weight when
    residual [M, K] is given; the new residual (x + residual in x's dtype) is returned as a new tensor.
    silu_mul: weight is a fused [gate; up] of 2I rows and out = silu(x @ gate.T) * (x @ up.T), [M, I].
    out_dtype: the result, rounded to x's dtype, is stored in this dtype (default x's dtype).
    weight_scale: float32 [N] for an FP8 weight (engine/models/fp8.py): row n is weight[n] * weight_scale[n],
    dequantized in registers.
    Returns (out, new_residual or None).
    """
    _check_inputs(x, weight, norm_weight, residual)
    _check_scale(weight, weight_scale)
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("silu_mul needs an even number of weight rows and no bias")
    rows, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    tile = tile or default_gemv_tile(rows, n, k, sm_count(x.device), silu_mul, weight.element_size())
    return out, _launch(x, weight, weight_scale, bias, norm_weight, residual, eps, out, n, tile, silu_mul=silu_mul)


def gemv_rope_store(
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
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_scale: torch.Tensor | None = None,
    tile: GemvTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The input side of decode attention in one kernel: qkv = f(x) @ weight.T (+ bias) for a fused
    [q; k; v] weight, f as in gemv; rotary embedding of q and k at `positions`; rotated k and v
    written into the paged caches at slot_mapping [M] (-1: skipped). Returns (rotated q [M, Hq, D],
    new_residual or None). Equals gemv + kernels.rope_kv_store.rope_and_store_kv."""
    _check_inputs(x, weight, norm_weight, residual)
    _check_scale(weight, weight_scale)
    q_size, kv_size, head_dim = rope_store_shapes(x, weight, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
                                                  num_heads)
    rows, k = x.shape
    pairs = weight.shape[0] // 2
    q = torch.empty((rows, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if tile is None:  # the plain GEMV's tile for these weight rows, in pairs
        plain = default_gemv_tile(rows, weight.shape[0], k, sm_count(x.device), weight_bytes=weight.element_size())
        tile = plain._replace(block_n=max(1, plain.block_n // 2))
    rope = (positions, cos_sin_cache, slot_mapping, k_cache, v_cache, q_size, kv_size, head_dim)
    return q, _launch(x, weight, weight_scale, bias, norm_weight, residual, eps, q.view(rows, q_size), pairs, tile,
                      rope=rope)


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused path in float32 arithmetic, rounded to x's dtype where the decoder rounds
    (an FP8 weight dequantized in float32)."""
    from graphserve.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref

    new_residual = None
    h = x
    if norm_weight is not None:
        if residual is not None:
            h, new_residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
        else:
            h = rms_norm_ref(x, norm_weight, eps)
    w = weight.float() if weight_scale is None else weight.float() * weight_scale.float()[:, None]
    y = h.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if silu_mul:
        inter = y.shape[-1] // 2
        gate, up = y[..., :inter].float(), y[..., inter:].float()
        y = (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)
    return y.to(out_dtype or x.dtype), new_residual



def gemv_rope_store_ref(x, weight, bias, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, num_heads, *,
                        norm_weight=None, residual=None, eps=1e-6,
                        weight_scale=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gemv_ref, then rotary and the cache write as kernels.rope_kv_store's reference does."""
    from graphserve.kernels.rope_kv_store import rope_and_store_kv_ref

    qkv, new_residual = gemv_ref(x, weight, bias, norm_weight=norm_weight, residual=residual, eps=eps,
                                 weight_scale=weight_scale)
    head_dim, num_kv_heads = k_cache.shape[3], k_cache.shape[2]
    heads = qkv.view(x.shape[0], -1, head_dim)
    q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    q = q.clone()
    rope_and_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return q, new_residual
