"""gpt-oss's MXFP4 experts at one or two tokens as two matrix-vector kernels on the CUDA cores: the 4-bit blocks
and e8m0 scales read as stored and decoded in registers, no tensor-core tile (no 16-row padding, no layout
change before a tl.dot), no alignment, no per-pick buffer, no combine kernel.

- _gate_up_kernel, one program per (pick, tile of BLOCK_N intermediate rows): the pick's expert id read on the
  device, its gate and up rows times the pick's token, the biases and the clamped SwiGLU, into h [T*k, I].
- _down_kernel, one program per (token, tile of BLOCK_N outputs): for each of the token's k picks in order, the
  pick's expert's down rows times its row of h, the bias, times its routing weight, rounded and added in
  float32; rounded once at the end. Every rounding is kernels/gpt_oss_experts.py's grouped path's (its
  per-pick rows and combine, fused).

The decode (_group_sums): a byte's low nibble is element 2j, its high one 2j + 1 (kernels/mxfp4.py). Each
nibble's 3 magnitude bits go to bits 9-11 of an fp16 and its sign to bit 15: that fp16 is the e2m1 value times
2^-14 exactly (codes 0 and 1 land on fp16's subnormals, which its conversion to float32 keeps), four integer
operations and a conversion a value. The low nibbles meet the token's even elements and the high ones its odd
elements (no interleave); each group of 16 bytes (32 values) is summed, then scaled by 2^(s - 127 + 14) (the
scale's float32 bits built directly) and added into the row's sum.

Measured: not yet (benchmarks/moe_kernel_bench.py --shapes gpt-oss-20b times it beside the tensor-core paths).
gpt_oss_experts_ref (kernels/gpt_oss_experts.py) is the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphserve.kernels._pdl import wait_for_previous_kernel
from graphserve.kernels.launch_settings import use_pdl
from graphserve.kernels.mxfp4 import GROUP

# At most this many tokens take this path (gpt_oss_experts.gpt_oss_experts picks it). Untimed: an expert two
# tokens share is read twice here, so past one or two tokens the tensor-core paths should win.
GEMV_MAX_TOKENS = 2
_GROUP_BYTES = tl.constexpr(GROUP // 2)


class GptOssGemvTile(NamedTuple):
    """Weight rows (gate_up: row pairs) and K values a program an iteration, warps."""

    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _group_sums(packed, scales, x_even, x_odd, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over the tile's K of w * x, [BLOCK_N] float32, for packed uint8 [BLOCK_N, BLOCK_K / 2], scales uint8
    [BLOCK_N, BLOCK_K / 32] and the token's float32 elements x_even / x_odd [BLOCK_K / 2] (2j and 2j + 1)."""
    b = packed.to(tl.int32)
    lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    products = lo * x_even[None, :] + hi * x_odd[None, :]
    groups = tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // 32, _GROUP_BYTES]), 2)
    scale = ((scales.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) * 2^14
    return tl.sum(groups * scale, 1)


@triton.jit
def _row_product(w_rows, s_rows, x_row, n_mask, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] float32: the rows' MXFP4 weights (packed bytes from w_rows, scales from s_rows) times x_row[:K]."""
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_s = tl.arange(0, BLOCK_K // 32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        b_mask = (k0 // 2 + offs_b) < K // 2
        packed = tl.load(w_rows + k0 // 2 + offs_b[None, :], mask=n_mask[:, None] & b_mask[None, :], other=0)
        scales = tl.load(s_rows + k0 // 32 + offs_s[None, :],
                         mask=n_mask[:, None] & ((k0 // 32 + offs_s) < K // 32)[None, :], other=127)
        x_even = tl.load(x_row + k0 + 2 * offs_b, mask=b_mask, other=0.0).to(tl.float32)
        x_odd = tl.load(x_row + k0 + 2 * offs_b + 1, mask=b_mask, other=0.0).to(tl.float32)
        total += _group_sums(packed, scales, x_even, x_odd, BLOCK_N, BLOCK_K)
    return total


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, ids_ptr, h_ptr, N, K, alpha, limit,
                    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_h,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """h[p, n] = act(gate_e[n] . x_t + b, up_e[n] . x_t + b') for pick p (token t = p // TOP_K, expert e).
    PDL: the expert ids come from the kernel just before (routing), so nothing is read before the wait."""
    pick = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if PDL:
        wait_for_previous_kernel()
    expert = tl.load(ids_ptr + pick).to(tl.int64)
    x_row = x_ptr + (pick // TOP_K) * stride_x
    rows = offs_n.to(tl.int64)[:, None]
    w_rows = w_ptr + expert * stride_we + rows * stride_wn
    s_rows = s_ptr + expert * stride_se + rows * stride_sn
    gate = _row_product(w_rows, s_rows, x_row, n_mask, K, BLOCK_N, BLOCK_K)
    up = _row_product(w_rows + N * stride_wn, s_rows + N * stride_sn, x_row, n_mask, K, BLOCK_N, BLOCK_K)
    dt = h_ptr.dtype.element_ty
    b_ptrs = bias_ptr + expert * stride_be + offs_n
    gate = (gate.to(dt) + tl.load(b_ptrs, mask=n_mask, other=0.0)).to(dt).to(tl.float32)
    up = (up.to(dt) + tl.load(b_ptrs + N, mask=n_mask, other=0.0)).to(dt).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    y = (up + 1.0) * (gate / (1.0 + tl.exp(-gate * alpha)))
    tl.store(h_ptr + pick * stride_h + offs_n, y.to(dt), mask=n_mask)


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, bias_ptr, ids_ptr, routing_ptr, out_ptr, N, K,
                 stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_o,
                 TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[t, n] = sum over t's picks p in order of round(w_p * round(down_e[n] . h[p] + c_e[n])), in float32,
    rounded once. PDL: h comes from the kernel just before."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dt = out_ptr.dtype.element_ty
    if PDL:
        wait_for_previous_kernel()
    rows = offs_n.to(tl.int64)[:, None]
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pick = token * TOP_K + j
        expert = tl.load(ids_ptr + pick).to(tl.int64)
        y = _row_product(w_ptr + expert * stride_we + rows * stride_wn, s_ptr + expert * stride_se + rows * stride_sn,
                         h_ptr + pick * stride_h, n_mask, K, BLOCK_N, BLOCK_K)
        y = (y.to(dt) + tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0)).to(dt).to(tl.float32)
        total += (y * tl.load(routing_ptr + pick)).to(dt).to(tl.float32)
    tl.store(out_ptr + token * stride_o + offs_n, total.to(dt), mask=n_mask)


def default_gemv_tiles(tokens: int, top_k: int, hidden: int, inter: int,
                       num_sms: int) -> tuple[GptOssGemvTile, GptOssGemvTile]:
    """(gate_up, down): 256 values (128 bytes) of a row an iteration, rows narrowed from 16 until the programs
    (picks x row tiles for gate_up, tokens x row tiles for down) give every SM four. Untimed first choices."""
    tiles = []
    for programs_a_tile, n, k in ((tokens * top_k, inter, hidden), (tokens, hidden, inter)):
        block_n = 16
        while block_n > 1 and programs_a_tile * triton.cdiv(n, block_n) < 4 * num_sms:
            block_n //= 2
        tiles.append(GptOssGemvTile(block_n, min(256, max(GROUP, triton.next_power_of_2(k))), 4))
    return tiles[0], tiles[1]


def gpt_oss_experts_gemv(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                         gate_up_blocks: torch.Tensor, down_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
                         down_scales: torch.Tensor, gate_up_bias: torch.Tensor, down_bias: torch.Tensor,
                         alpha: float, limit: float,
                         tiles: tuple[GptOssGemvTile, GptOssGemvTile]) -> torch.Tensor:
    """The routed experts' weighted sum [T, H], inputs as gpt_oss_experts checked them (MXFP4 experts)."""
    tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    inter = down_blocks.shape[2] * 2
    ids = expert_ids.contiguous()
    routing = weights.contiguous()
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    gate_up_tile, down_tile = tiles
    pdl = use_pdl(x.device)
    _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, gate_up_tile.block_n))](
        x, gate_up_blocks, gate_up_scales, gate_up_bias, ids, h, inter, hidden, float(alpha), float(limit),
        x.stride(0), gate_up_blocks.stride(0), gate_up_blocks.stride(1), gate_up_scales.stride(0),
        gate_up_scales.stride(1), gate_up_bias.stride(0), h.stride(0),
        TOP_K=top_k, BLOCK_N=gate_up_tile.block_n, BLOCK_K=gate_up_tile.block_k, PDL=pdl,
        num_warps=gate_up_tile.num_warps, launch_pdl=pdl)
    _down_kernel[(tokens, triton.cdiv(hidden, down_tile.block_n))](
        h, down_blocks, down_scales, down_bias, ids, routing, out, hidden, inter,
        h.stride(0), down_blocks.stride(0), down_blocks.stride(1), down_scales.stride(0), down_scales.stride(1),
        down_bias.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_N=down_tile.block_n, BLOCK_K=down_tile.block_k, PDL=pdl,
        num_warps=down_tile.num_warps, launch_pdl=pdl)
    return out
