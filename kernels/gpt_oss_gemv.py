"""gpt-oss's MXFP4 experts at one or two tokens as two matrix-vector kernels on the CUDA cores: the 4-bit blocks
and e8m0 scales read as stored and decoded in registers, no tensor-core tile (no 16-row padding, no layout
change before a tl.dot), no alignment, no per-pick buffer, no combine kernel.

- _gate_up_kernel, one program per (pick, tile of BLOCK_N intermediate rows): the pick's expert id read on the
  device, its gate and up rows times the pick's token, the biases and the clamped SwiGLU, into h [T*k, I].
- _down_kernel, one program per (token, tile of BLOCK_N outputs): for each of the token's k picks in order, the
  pick's expert's down rows times its row of h, the bias, times its routing weight, rounded and added in
  float32; rounded once at the end. Every rounding is kernels/gpt_oss_experts.py's grouped path's (its
  per-pick rows and combine, fused).

The decode (_fp16_pair, _word_sums): the blocks are read as int32 words of eight e2m1 values (value i at bits
4i..4i+3: a byte's low nibble first, kernels/mxfp4.py). For each pair of nibbles i and i + 4 of a word, two
shifts and two masks put each one's 3 magnitude bits at bits 9-11 and its sign at bit 15 of one half of an
fp16 pair: each half is the e2m1 value times 2^-14 exactly (codes 0 and 1 land on fp16's subnormals, which the
conversion to float32 keeps). The token's elements are loaded contiguously and split into the eight strided
columns the pairs meet; the products run as one chain of multiply-adds a word, each group of 32 values (four
words) is summed, then scaled by 2^(s - 127 + 14) (the scale's float32 bits built directly). Each weight tile is
loaded an iteration ahead of its use.

Compiled for sm_90 (tests/hopper_compile.py's compiler, cuobjdump): the inner loop issues about 5.9
thread-instructions a weight at 16 x 256 tiles (64-86 registers), where the tensor-core paths' tl.dot_scaled
upcast issues about 10.3 at the decode tiles (128 registers) -- the decode's issue rate, not the bytes, bounds
all of them at one token (an H100 issues about 0.93 T warp-instructions a second against 5.6 T weights a second
of bandwidth). Measured: not yet (benchmarks/moe_kernel_bench.py --shapes gpt-oss-20b).
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
GEMV_PROGRAMS_PER_SM = 2


class GptOssGemvTile(NamedTuple):
    """Weight rows (gate_up: row pairs) and K values a program an iteration, warps."""

    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _fp16_pair(words, shift: tl.constexpr):
    """float32 values of the nibbles at bits shift..shift+3 and shift+16..shift+19 of each int32 word: each
    nibble's magnitude to bits 9-11 and its sign to bit 15 of an fp16 (the e2m1 value times 2^-14, exactly)."""
    if shift <= 9:
        mags = (words << (9 - shift)) & 0x0E000E00
    else:
        mags = (words >> (shift - 9)) & 0x0E000E00
    bits = mags | ((words << (12 - shift)) & -0x7FFF8000)  # 0x80008000: bits 15 and 31
    lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word_sums(words, scales, x_row, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over the tile's K of w * x, [BLOCK_N] float32, for words int32 [BLOCK_N, BLOCK_K / 8] (eight e2m1
    values each, value i at bits 4i..4i+3), scales uint8 [BLOCK_N, BLOCK_K / 32] and the token's row x_row."""
    offs = tl.arange(0, BLOCK_K)
    x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
    # x[8j + 4h + 2a + b] as [j, h, a, b], split into its eight columns (s = 2a + b: value s, h = 1: s + 4)
    x_b0, x_b1 = tl.split(tl.reshape(x, [BLOCK_K // 8, 2, 2, 2]))
    x_s0, x_s2 = tl.split(x_b0)
    x_s1, x_s3 = tl.split(x_b1)
    products = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    products = _pair_products(products, words, 0, x_s0)  # one chain of multiply-adds
    products = _pair_products(products, words, 4, x_s1)
    products = _pair_products(products, words, 8, x_s2)
    products = _pair_products(products, words, 12, x_s3)
    groups = tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // 32, 4]), 2)
    scale = ((scales.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) * 2^14
    return tl.sum(groups * scale, 1)


@triton.jit
def _pair_products(acc, words, shift: tl.constexpr, x_pair):
    """acc + lo * x[j, 0] + hi * x[j, 1] for the nibbles at bits shift.. and shift+16.. of each word (_fp16_pair)
    and x_pair [BLOCK_K / 8, 2] their elements."""
    lo, hi = _fp16_pair(words, shift)
    x_lo, x_hi = tl.split(x_pair)
    return acc + lo * x_lo[None, :] + hi * x_hi[None, :]


@triton.jit
def _row_product(w_rows, s_rows, x_row, n_mask, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] float32: the rows' MXFP4 weights (int32 words of packed bytes from w_rows, scales from s_rows)
    times x_row[:K]. Each weight tile is loaded an iteration ahead of its use (twice the bytes in flight)."""
    words, scales = _weight_tile(w_rows, s_rows, n_mask, 0, K, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        next_words, next_scales = _weight_tile(w_rows, s_rows, n_mask, k0 + BLOCK_K, K, BLOCK_K)
        total += _word_sums(words, scales, x_row, k0, K, BLOCK_N, BLOCK_K)
        words, scales = next_words, next_scales
    return total


@triton.jit
def _weight_tile(w_rows, s_rows, n_mask, k0, K, BLOCK_K: tl.constexpr):
    """The rows' int32 words and scales of values k0..k0+BLOCK_K (zeros, and scale 1, past K)."""
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_s = tl.arange(0, BLOCK_K // 32)
    words = tl.load(w_rows + k0 // 8 + offs_w[None, :], mask=n_mask[:, None] & ((k0 // 8 + offs_w) < K // 8)[None, :],
                    other=0)
    scales = tl.load(s_rows + k0 // 32 + offs_s[None, :], mask=n_mask[:, None] & ((k0 // 32 + offs_s) < K // 32)[None, :],
                     other=127)
    return words, scales


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
    """(gate_up, down): 256 values (128 bytes) of 16 rows an iteration, 4 warps (four words a thread: the fewest
    instructions a weight of the tiles compiled for sm_90), rows narrowed until the programs (picks x row tiles for
    gate_up, tokens x row tiles for down) give every SM GEMV_PROGRAMS_PER_SM. Untimed first choices."""
    tiles = []
    for programs_a_tile, n, k in ((tokens * top_k, inter, hidden), (tokens, hidden, inter)):
        block_n = 16
        while block_n > 4 and programs_a_tile * triton.cdiv(n, block_n) < GEMV_PROGRAMS_PER_SM * num_sms:
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
    gate_up_words, down_words = gate_up_blocks.view(torch.int32), down_blocks.view(torch.int32)  # 8 values a word
    _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, gate_up_tile.block_n))](
        x, gate_up_words, gate_up_scales, gate_up_bias, ids, h, inter, hidden, float(alpha), float(limit),
        x.stride(0), gate_up_words.stride(0), gate_up_words.stride(1), gate_up_scales.stride(0),
        gate_up_scales.stride(1), gate_up_bias.stride(0), h.stride(0),
        TOP_K=top_k, BLOCK_N=gate_up_tile.block_n, BLOCK_K=gate_up_tile.block_k, PDL=pdl,
        num_warps=gate_up_tile.num_warps, launch_pdl=pdl)
    _down_kernel[(tokens, triton.cdiv(hidden, down_tile.block_n))](
        h, down_words, down_scales, down_bias, ids, routing, out, hidden, inter,
        h.stride(0), down_words.stride(0), down_words.stride(1), down_scales.stride(0), down_scales.stride(1),
        down_bias.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_N=down_tile.block_n, BLOCK_K=down_tile.block_k, PDL=pdl,
        num_warps=down_tile.num_warps, launch_pdl=pdl)
    return out
