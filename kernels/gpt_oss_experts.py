"""gpt-oss's routed experts on the GPU: MXFP4 (as its checkpoints store them) or bf16 / fp16 / fp32 weights,
with biases and its clamped SwiGLU.

    out[t] = sum over token t's k picks (expert e, weight w) of w * (down_e(act(gate_up_e x_t + b_e)) + c_e)
    act(gate, up) = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)

The grouped path of kernels/moe.py, for every batch: moe_align groups the T*k picks by expert in blocks of
block_m (kernels/moe_align.py), then _experts_gemm_kernel, one program per (block of picks, tile of
block_n outputs), runs the block's expert's weight tile times the block's rows ("swap AB": the weights on
the wide side of the tensor-core product, the picks -- as few as 1 -- on the narrow one), twice:
- gate_up: rows gathered from x, the gate and up tiles of the same outputs (rows n and I + n of the
  expert's [gate; up] weight: the loader de-interleaves gpt-oss's alternating rows), the biases and the
  activation in the epilogue, into h [padded picks, I];
- down: rows of h, the bias and the pick's routing weight in the epilogue, into the pick's row of [T*k, H];
then kernels/moe.py's combine sums each token's k rows in float32.

Decode steps of up to SMALL_BATCH_MAX_TOKENS tokens skip the alignment (SMALL_PATH): the same kernel with one
program per (pick, output tile), of which an expert's first pick works, over all the tokens that chose the
expert (token m in row m of its block of 16), so every chosen expert's weights are read once and no program
finds nothing to do; h is indexed by pick. The epilogues, and so every rounding, are the grouped path's.

MXFP4 weights arrive as stored: uint8 [E, N, K / 2] (two e2m1 values a byte) with uint8 e8m0 scales
[E, N, K / 32] (kernels/mxfp4.py), read at those bytes. Beside bf16 / fp16 activations each weight tile
goes to tl.dot_scaled (e2m1 with its scales against the activations: Triton upcasts it in registers);
beside float32 ones (the exactness tests) it is decoded to float32 bit for bit (mxfp4.decode_tile) for an
ieee tl.dot. MXFP4 is a constexpr: the bf16 path compiles without it.
gpt_oss_experts_ref is the float32 torch reference (MXFP4 weights dequantized).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphserve.kernels.gpt_oss_gemv import GEMV_MAX_TOKENS, GptOssGemvTile, default_gemv_tiles, gpt_oss_experts_gemv
from graphserve.kernels.launch_settings import dot_precision, sm_count
from graphserve.kernels.moe import MoeTile, _combine_kernel, default_moe_tiles
from graphserve.kernels.moe_align import moe_align
from graphserve.kernels.mxfp4 import GROUP, decode_tile, dequantize


@triton.jit
def _weight_product(acc, w_ptrs, s_ptrs, a, n_mask, k0, K, MXFP4: tl.constexpr, DOT_FORMAT: tl.constexpr,
                    DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + W[rows, k0:k0+BLOCK_K] @ a.T for a [BLOCK_M, BLOCK_K]. MXFP4: w_ptrs point at the rows' packed
    bytes from k0 / 2 on, s_ptrs at their scales from k0 / 32 on; else w_ptrs at the rows' values."""
    if MXFP4:
        offs_b = tl.arange(0, BLOCK_K // 2)
        offs_s = tl.arange(0, BLOCK_K // 32)
        packed = tl.load(w_ptrs + offs_b[None, :], mask=n_mask[:, None] & (k0 // 2 + offs_b < K // 2)[None, :],
                         other=0)
        scales = tl.load(s_ptrs + offs_s[None, :], mask=n_mask[:, None] & (k0 // 32 + offs_s < K // 32)[None, :],
                         other=127)
        if DOT_FORMAT == "fp32":
            w = decode_tile(packed, scales, BLOCK_N, BLOCK_K)
            acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PREC)
        else:
            acc = tl.dot_scaled(packed, scales, "e2m1", tl.trans(a), None, DOT_FORMAT, acc)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptrs + offs_k[None, :], mask=n_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _experts_gemm_kernel(
    a_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, sorted_picks_ptr, block_experts_ptr, num_padded_ptr, routing_ptr,
    N, K, num_picks, alpha, limit,
    stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_o,
    TOP_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    MXFP4: tl.constexpr,
    DOT_FORMAT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ALIGNED: tl.constexpr,
    PICKS_PAD: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """GATE_UP: a = x [T, K], w = gate_up [E, 2N, K or K / 2], bias [E, 2N]; out = h at the picks' rows of h.
    Otherwise (down): a = h, w = down [E, N, K or K / 2], bias [E, N]; out [T*k, N] at each pick's row, times
    its routing weight. MXFP4: s_ptr holds the scales [E, rows, K / 32].
    ALIGNED (moe_align's blocks): program 0-axis = a block of BLOCK_M padded positions of one expert; h
    [padded, N] is indexed by padded position. Not ALIGNED (the small-batch path, T <= BLOCK_M): program
    0-axis = pick p (sorted_picks_ptr: the expert ids [T*k]); only an expert's first pick works, over every
    token that chose the expert (row m = token m); h [T*k, N] is indexed by pick."""
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    if ALIGNED:
        if block * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_experts_ptr + block).to(tl.int64)
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # padded positions
        picks = tl.load(sorted_picks_ptr + offs_m)
        real = picks < num_picks
        h_rows = offs_m.to(tl.int64)
    else:
        expert = tl.load(sorted_picks_ptr + block)
        offs_q = tl.arange(0, PICKS_PAD)
        ids = tl.load(sorted_picks_ptr + offs_q, mask=offs_q < num_picks, other=-1)
        if tl.sum(((ids == expert) & (offs_q < block)).to(tl.int32)) > 0:  # an earlier pick runs this expert
            return
        expert = expert.to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)  # tokens
        offs_j = tl.arange(0, TOP_K_PAD)
        token_picks = offs_m[:, None] * TOP_K + offs_j[None, :]
        chosen = tl.load(sorted_picks_ptr + token_picks, mask=(offs_j < TOP_K)[None, :] & (token_picks < num_picks),
                         other=-1) == expert
        real = tl.max(chosen.to(tl.int32), 1) > 0  # (an expert is picked at most once a token)
        picks = tl.where(real, tl.sum(tl.where(chosen, token_picks, 0), 1), num_picks)
        h_rows = picks.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if GATE_UP:
        a_rows = (picks // TOP_K).to(tl.int64)  # each pick's token
    else:
        a_rows = h_rows
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]
    rows = offs_n.to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn
    s_ptrs = s_ptr + expert * stride_se + rows[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=real[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        acc = _weight_product(acc, w_ptrs, s_ptrs, a, n_mask, k0, K, MXFP4, DOT_FORMAT, DOT_PREC, BLOCK_N, BLOCK_K)
        if GATE_UP:  # up row N + n beside gate row n
            acc_u = _weight_product(acc_u, w_ptrs + N * stride_wn, s_ptrs + N * stride_sn, a, n_mask, k0, K, MXFP4,
                                    DOT_FORMAT, DOT_PREC, BLOCK_N, BLOCK_K)
        a_ptrs += BLOCK_K
        if MXFP4:
            w_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 32
        else:
            w_ptrs += BLOCK_K

    dt = out_ptr.dtype.element_ty
    b_ptrs = bias_ptr + expert * stride_be + offs_n
    if GATE_UP:  # the projection and its bias rounded as transformers rounds them, the activation once
        gate = (acc.to(dt) + tl.load(b_ptrs, mask=n_mask, other=0.0)[:, None]).to(dt).to(tl.float32)
        up = (acc_u.to(dt) + tl.load(b_ptrs + N, mask=n_mask, other=0.0)[:, None]).to(dt).to(tl.float32)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        y = (up + 1.0) * (gate / (1.0 + tl.exp(-gate * alpha)))
        o_ptrs = out_ptr + h_rows[None, :] * stride_o + offs_n[:, None]
        tl.store(o_ptrs, y.to(dt), mask=n_mask[:, None] & real[None, :])
    else:
        y = (acc.to(dt) + tl.load(b_ptrs, mask=n_mask, other=0.0)[:, None]).to(dt).to(tl.float32)
        weight = tl.load(routing_ptr + picks, mask=real, other=0.0)
        o_ptrs = out_ptr + picks.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
        tl.store(o_ptrs, (y * weight[None, :]).to(dt), mask=n_mask[:, None] & real[None, :])


_DOT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Decode steps of up to SMALL_BATCH_MAX_TOKENS tokens run without moe_align (SMALL_PATH): a program a pick and
# output tile, the expert's first pick working over all its tokens (so every chosen expert is read once), h
# indexed by pick; 4 kernels a layer (route, gate_up, down, combine) against 5, and no programs that find
# nothing to do (the same inner loop as the grouped path). Off until timed on a GPU (decode_latency.py
# --gpt-oss-small-path on|off, moe_kernel_bench.py --shapes gpt-oss-20b).
SMALL_PATH = False
# MXFP4 experts at up to gpt_oss_gemv.GEMV_MAX_TOKENS tokens on the CUDA cores (kernels/gpt_oss_gemv.py). Its
# compiled code promises (about 5.9 instructions a weight and 64-86 registers against tl.dot_scaled's 10.3 and 128
# at the decode tiles, sm_90), but it is off until timed: decode_latency.py --gpt-oss-gemv on|off,
# moe_kernel_bench.py --shapes gpt-oss-20b.
GEMV_PATH = False
SMALL_BATCH_MAX_TOKENS = 16  # a block of 16 rows, the smallest tl.dot side, holds every token
SMALL_PROGRAMS_PER_SM = 2
# MXFP4 K tiles: this many bytes of a weight row an iteration (64: 128 values, the tiles first measured).
MXFP4_K_TILE_BYTES = 64


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor,
           down_bias: torch.Tensor, gate_up_scales: torch.Tensor | None,
           down_scales: torch.Tensor | None) -> tuple[int, int, int, bool]:
    """(experts, hidden, intermediate, MXFP4), or ValueError."""
    mxfp4 = gate_up.dtype == torch.uint8
    if x.dtype not in _DOT_FORMATS or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] bf16, fp16 or fp32 with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    inter = down.shape[2] * (2 if mxfp4 else 1)
    if mxfp4:
        want = {"gate_up": (gate_up, (num_experts, 2 * inter, hidden // 2)), "down": (down, (num_experts, hidden, inter // 2)),
                "gate_up_scales": (gate_up_scales, (num_experts, 2 * inter, hidden // GROUP)),
                "down_scales": (down_scales, (num_experts, hidden, inter // GROUP))}
        if hidden % GROUP or inter % GROUP:
            raise ValueError(f"MXFP4 experts need hidden {hidden} and intermediate {inter} multiples of {GROUP}")
    else:
        want = {"gate_up": (gate_up, (num_experts, 2 * inter, hidden)), "down": (down, (num_experts, hidden, inter))}
        if gate_up_scales is not None or down_scales is not None or gate_up.dtype != x.dtype or down.dtype != x.dtype:
            raise ValueError("unquantized experts take x's dtype and no scales")
    want |= {"gate_up_bias": (gate_up_bias, (num_experts, 2 * inter)), "down_bias": (down_bias, (num_experts, hidden))}
    for name, (tensor, shape) in want.items():
        if tensor is None or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous {shape}, got "
                             f"{None if tensor is None else (tensor.dtype, tuple(tensor.shape))}")
        if name.endswith("scales") and tensor.dtype != torch.uint8 or name.endswith("bias") and tensor.dtype != x.dtype:
            raise ValueError(f"{name} must be {'uint8' if name.endswith('scales') else x.dtype}, got {tensor.dtype}")
    if mxfp4 and down.dtype != torch.uint8:
        raise ValueError("MXFP4 experts need gate_up and down both uint8")
    return num_experts, hidden, inter, mxfp4


def gpt_oss_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, gate_up_bias: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                    limit: float, *, gate_up_scales: torch.Tensor | None = None,
                    down_scales: torch.Tensor | None = None,
                    tiles: tuple[MoeTile, MoeTile] | tuple[GptOssGemvTile, GptOssGemvTile] | None = None,
                    path: str | None = None) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] for x [T, H], routing weights [T, k] float32 and expert ids
    [T, k] (kernels/moe_route.route_fused). Experts: gate_up [E, 2I, H] (each expert's gate rows, then its
    up rows) and down [E, H, I] in x's dtype, or MXFP4: uint8 [E, 2I, H / 2] and [E, H, I / 2] with uint8
    gate_up_scales [E, 2I, H / 32] and down_scales [E, H, I / 32]; biases [E, 2I] and [E, H] in x's dtype.
    path: "gemv" (MXFP4, T <= gpt_oss_gemv.GEMV_MAX_TOKENS: kernels/gpt_oss_gemv.py), "small" (T <=
    SMALL_BATCH_MAX_TOKENS: no alignment) or "grouped"; None: pick_path. tiles: (gate_up, down) launch shapes,
    MoeTile with one block_m, or GptOssGemvTile for the GEMV path (benchmark sweeps)."""
    num_experts, hidden, inter, mxfp4 = _check(x, gate_up, down, gate_up_bias, down_bias, gate_up_scales,
                                               down_scales)
    tokens, top_k = expert_ids.shape
    if tokens != x.shape[0] or weights.shape != expert_ids.shape:
        raise ValueError(f"routing {tuple(expert_ids.shape)} / {tuple(weights.shape)} for {x.shape[0]} tokens")
    if tokens == 0:
        return torch.zeros_like(x)
    path = path or pick_path(tokens, mxfp4)
    limits = {"gemv": GEMV_MAX_TOKENS, "small": SMALL_BATCH_MAX_TOKENS, "grouped": None}
    if path not in limits or path == "gemv" and not mxfp4:
        raise ValueError(f"path {path!r}: 'gemv' (MXFP4 experts), 'small' or 'grouped'")
    if limits[path] is not None and tokens > limits[path]:
        raise ValueError(f"the {path} path takes at most {limits[path]} tokens, got {tokens}")
    if path == "gemv":
        return gpt_oss_experts_gemv(x, weights, expert_ids, gate_up, down, gate_up_scales, down_scales, gate_up_bias,
                                    down_bias, alpha, limit,
                                    tiles or default_gemv_tiles(tokens, top_k, hidden, inter, sm_count(x.device)))
    small = path == "small"
    gate_up_tile, down_tile = tiles or gpt_oss_tiles(tokens, top_k, num_experts, hidden, inter, sm_count(x.device),
                                                     x.element_size(), mxfp4, small)
    if gate_up_tile.block_m != down_tile.block_m:
        raise ValueError("both GEMMs' tiles need the same block_m (the alignment's)")
    if small and gate_up_tile.block_m < tokens:
        raise ValueError(f"the small-batch path needs block_m >= the {tokens} tokens")
    if mxfp4 and min(gate_up_tile.block_k, down_tile.block_k) < GROUP:
        raise ValueError(f"MXFP4 tiles need block_k >= {GROUP}")
    num_picks = tokens * top_k
    if small:  # a program a pick, the expert's first pick working (ids in place of the aligned picks)
        ids = expert_ids.reshape(-1).contiguous()
        sorted_picks, block_experts, num_padded, grid_m = ids, ids, ids, num_picks
        h_rows = num_picks
    else:
        aligned = moe_align(expert_ids, num_experts, gate_up_tile.block_m)
        sorted_picks, block_experts, num_padded = aligned.sorted_picks, aligned.block_experts, aligned.num_padded
        grid_m, h_rows = block_experts.shape[0], sorted_picks.shape[0]
    h = torch.empty((h_rows, inter), dtype=x.dtype, device=x.device)
    per_pick = torch.empty((num_picks, hidden), dtype=x.dtype, device=x.device)
    routing = weights.reshape(-1).contiguous()
    for a, w, scales, bias, out, n, k, tile, is_gate_up in (
            (x, gate_up, gate_up_scales, gate_up_bias, h, inter, hidden, gate_up_tile, True),
            (h, down, down_scales, down_bias, per_pick, hidden, inter, down_tile, False)):
        scales = w if scales is None else scales  # a pointer the unquantized path never reads
        _experts_gemm_kernel[(grid_m, triton.cdiv(n, tile.block_n))](
            a, w, scales, bias, out, sorted_picks, block_experts, num_padded, routing,
            n, k, num_picks, float(alpha), float(limit),
            a.stride(0), w.stride(0), w.stride(1), scales.stride(0), scales.stride(1), bias.stride(0), out.stride(0),
            TOP_K=top_k, GATE_UP=is_gate_up, MXFP4=mxfp4, DOT_FORMAT=_DOT_FORMATS[x.dtype],
            DOT_PREC=dot_precision(x.dtype), ALIGNED=not small,
            PICKS_PAD=tile.block_m * triton.next_power_of_2(top_k), TOP_K_PAD=triton.next_power_of_2(top_k),
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
    out = torch.empty_like(x)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block_h))](per_pick, out, hidden, TOP_K=top_k, BLOCK_H=block_h)
    return out


def pick_path(tokens: int, mxfp4: bool) -> str:
    """The path a batch of `tokens` takes: GEMV_PATH's GEMV for MXFP4 experts up to GEMV_MAX_TOKENS, SMALL_PATH's
    small-batch path up to SMALL_BATCH_MAX_TOKENS, else the grouped one."""
    if GEMV_PATH and mxfp4 and tokens <= GEMV_MAX_TOKENS:
        return "gemv"
    return "small" if SMALL_PATH and tokens <= SMALL_BATCH_MAX_TOKENS else "grouped"


def gpt_oss_tiles(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, num_sms: int,
                  elem_bytes: int, mxfp4: bool, small: bool) -> tuple[MoeTile, MoeTile]:
    """(gate_up, down) launch shapes for rows of elem_bytes: kernels/moe.default_moe_tiles' choice, MXFP4 K tiles
    beside 16-bit rows MXFP4_K_TILE_BYTES of a weight row wide; the small-batch path: blocks of 16 tokens and
    output tiles narrowed until the chosen experts give every SM SMALL_PROGRAMS_PER_SM programs."""
    gate_up, down = default_moe_tiles(tokens, top_k, num_experts, hidden, inter, num_sms, elem_bytes)
    if mxfp4 and elem_bytes == 2:
        gate_up, down = (t._replace(block_k=min(2 * MXFP4_K_TILE_BYTES, max(GROUP, triton.next_power_of_2(k))))
                         for t, k in ((gate_up, hidden), (down, inter)))
    if not small:
        return gate_up, down
    experts_used = min(num_experts, tokens * top_k)
    tiles = []
    for tile, n in ((gate_up, inter), (down, hidden)):
        block_n = 64
        while block_n > 16 and experts_used * triton.cdiv(n, block_n) < SMALL_PROGRAMS_PER_SM * num_sms:
            block_n //= 2
        tiles.append(tile._replace(block_m=SMALL_BATCH_MAX_TOKENS, block_n=min(block_n, max(16, triton.next_power_of_2(n)))))
    return tiles[0], tiles[1]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation as transformers' GptOssExperts._apply_gate computes it, in the inputs' dtype."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_experts_ref(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, gate_up_bias: torch.Tensor, down_bias: torch.Tensor, alpha: float,
                        limit: float, gate_up_scales: torch.Tensor | None = None,
                        down_scales: torch.Tensor | None = None) -> torch.Tensor:
    """float32 reference (host-synchronizing): each chosen expert over its tokens in float32 (MXFP4 weights
    dequantized), weighted and added into their rows."""
    if gate_up.dtype == torch.uint8:
        gate_up, down = dequantize(gate_up, gate_up_scales), dequantize(down, down_scales)
    xf = x.float()
    out = torch.zeros_like(xf)
    for expert in expert_ids.unique().tolist():
        tokens, slots = (expert_ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(xf[tokens], gate_up[expert].float(), gate_up_bias[expert].float()).chunk(2, dim=-1)
        y = F.linear(clamped_swiglu(gate, up, alpha, limit), down[expert].float(), down_bias[expert].float())
        out.index_add_(0, tokens, y * weights[tokens, slots, None].float())
    return out
