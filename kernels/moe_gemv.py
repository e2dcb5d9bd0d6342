"""The routed experts at decode sizes as two matrix-vector kernels: no alignment, no per-pick buffer,
no combine kernel (kernels/moe.py's grouped path needs all three).

- _gate_up_gemv_kernel, one program per (pick, tile of BLOCK_N intermediate rows): the pick's expert
  id is read on the device, its gate and up rows times the pick's token, SiLU-and-mul, into h [T*k, I].
- _down_gemv_kernel, one program per (token, tile of BLOCK_N outputs): for each of the token's k picks
  in order, the pick's expert's down rows times its row of h, times its routing weight, rounded and
  added in float32; rounded once at the end -- the grouped path's per-pick rows and combine, fused.

Each program reads its rows of one expert's weights once, over the whole K, as kernels/gemv.py does for
a dense projection (one weight tile read an iteration ahead of its use, products summed in float32).
An expert two tokens both pick is read twice, so this path is for the few tokens of a decode step
(fused_experts picks it up to GEMV_MAX_TOKENS); at one token every chosen expert is read exactly once.
Rounding follows the grouped path step by step. Measured and removed (ec17c4f): the down kernel's tile read
ahead crossing from a pick's last K tile to the next pick's first (H100, Qwen3-30B-A3B at one token:
13.5 us against 13.0, decode 290.1 against 294.6 tok/s). FP8 experts arrive as int8 bytes and take
kernels/gemv.py's exact two-integer-operation widening (q * 2^-120, inputs and sums rescaled by powers
of two), then their per-output-channel scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel
from graphserve.kernels.gemv import _X_PRESCALE, _Y_RESCALE, _weight_f32, GemvTile, default_gemv_tile

# At most this many tokens take the GEMV path. H100, bf16, a layer (benchmarks/moe_kernel_bench.py, the
# router projection included; moe_kernel_bench-decode-paths-h100-2026-12-06.json), GEMV against grouped
# GEMMs: Qwen3-30B-A3B 1 token 38.8 / 45.2 us, 2: 72.0 / 74.0, 4: 118.0 / 110.2; Mixtral-8x7B 244.2 /
# 254.6, 471.4 / 479.5, 680.2 / 657.2. Past two tokens an expert two tokens share, read twice here, costs
# more than the grouped path's alignment and combine.
GEMV_MAX_TOKENS = 2


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, w_scale_ptr, ids_ptr, h_ptr, N, K,
                         stride_x, stride_we, stride_wn, stride_se, stride_h,
                         TOP_K: tl.constexpr, W_FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    """h[p, n] = silu(gate_e[n] . x_t) * (up_e[n] . x_t) for pick p (token t = p // TOP_K, expert e).
    PDL: the expert ids come from the kernel just before (routing), so nothing is read before the wait."""
    pick = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if PDL:
        wait_for_previous_kernel()
    expert = tl.load(ids_ptr + pick).to(tl.int64)
    x_row = x_ptr + (pick // TOP_K) * stride_x
    gate_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    mask = n_mask[:, None] & (offs_k < K)[None, :]
    g = tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0)
    u = tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        if W_FP8:
            xk = xk * _X_PRESCALE
        acc_g += _weight_f32(g, W_FP8) * xk[None, :]
        acc_u += _weight_f32(u, W_FP8) * xk[None, :]
        next_k = offs_k + BLOCK_K
        mask = n_mask[:, None] & (next_k < K)[None, :]
        g = tl.load(gate_rows + next_k[None, :], mask=mask, other=0.0)
        u = tl.load(up_rows + next_k[None, :], mask=mask, other=0.0)
    gate = tl.sum(acc_g, 1)
    up = tl.sum(acc_u, 1)
    if W_FP8:
        scales = w_scale_ptr + expert * stride_se + offs_n
        gate *= tl.load(scales, mask=n_mask, other=0.0) * _Y_RESCALE
        up *= tl.load(scales + N, mask=n_mask, other=0.0) * _Y_RESCALE
    dt = h_ptr.dtype.element_ty
    gate = gate.to(dt).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
    tl.store(h_ptr + pick * stride_h + offs_n, y.to(dt), mask=n_mask)


@triton.jit
def _down_gemv_kernel(h_ptr, w_ptr, w_scale_ptr, ids_ptr, routing_ptr, out_ptr, N, K,
                      stride_h, stride_we, stride_wn, stride_se, stride_o,
                      TOP_K: tl.constexpr, W_FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    """out[t, n] = sum over t's picks p in order of round(w_p * (down_e[n] . h[p])), in float32, rounded once.
    PDL: the expert ids (routing, two kernels back, so complete: kernels/_pdl.py) and the first pick's
    first weight tile are read before the wait for h."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dt = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    first_w = _first_down_tile(w_ptr, ids_ptr, token * TOP_K, offs_n, n_mask, K, stride_we, stride_wn, BLOCK_K)
    if PDL:
        wait_for_previous_kernel()
    for j in tl.static_range(TOP_K):
        pick = token * TOP_K + j
        expert = tl.load(ids_ptr + pick).to(tl.int64)
        h_row = h_ptr + pick * stride_h
        w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        offs_k = tl.arange(0, BLOCK_K)
        if j == 0:
            w = first_w
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            hk = tl.load(h_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            if W_FP8:
                hk = hk * _X_PRESCALE
            acc += _weight_f32(w, W_FP8) * hk[None, :]
            next_k = offs_k + BLOCK_K
            w = tl.load(w_rows + next_k[None, :], mask=n_mask[:, None] & (next_k < K)[None, :], other=0.0)
        y = tl.sum(acc, 1)
        if W_FP8:
            y *= tl.load(w_scale_ptr + expert * stride_se + offs_n, mask=n_mask, other=0.0) * _Y_RESCALE
        total += (y * tl.load(routing_ptr + pick)).to(dt).to(tl.float32)
    tl.store(out_ptr + token * stride_o + offs_n, total.to(dt), mask=n_mask)


@triton.jit
def _first_down_tile(w_ptr, ids_ptr, pick, offs_n, n_mask, K, stride_we, stride_wn, BLOCK_K: tl.constexpr):
    expert = tl.load(ids_ptr + pick).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    return tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)


def default_gemv_tiles(tokens: int, top_k: int, hidden: int, inter: int, num_sms: int,
                       weight_bytes: int = 2) -> tuple[GemvTile, GemvTile]:
    """(gate_up, down) tiles: kernels/gemv.py's choice for a SiLU-and-mul projection over T*k rows
    and for a plain one over T rows (each of the down's rows runs k experts' K in turn)."""
    return (default_gemv_tile(tokens * top_k, inter, hidden, num_sms, silu_mul=True, weight_bytes=weight_bytes),
            default_gemv_tile(tokens, hidden, inter, num_sms, weight_bytes=weight_bytes))


def experts_gemv(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, gate_up_scale: torch.Tensor | None, down_scale: torch.Tensor | None,
                 tiles: tuple[GemvTile, GemvTile]) -> torch.Tensor:
    """The routed experts' weighted sum [T, H], inputs as kernels/moe.fused_experts checked them
    (contiguous experts; FP8 ones with their float32 scales)."""
    tokens, hidden = x.shape
    inter, top_k = down.shape[2], expert_ids.shape[1]
    fp8 = gate_up_scale is not None
    ids = expert_ids.contiguous()
    routing = weights.contiguous()
    h = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    gate_up_tile, down_tile = tiles
    pdl = use_pdl(x.device)
    gate_up_w = gate_up.view(torch.int8) if fp8 else gate_up
    down_w = down.view(torch.int8) if fp8 else down
    _gate_up_gemv_kernel[(tokens * top_k, triton.cdiv(inter, gate_up_tile.block_n))](
        x, gate_up_w, gate_up_scale if fp8 else gate_up, ids, h, inter, hidden,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0) if fp8 else 0, h.stride(0),
        TOP_K=top_k, W_FP8=fp8, BLOCK_N=gate_up_tile.block_n, BLOCK_K=gate_up_tile.block_k, PDL=pdl,
        num_warps=gate_up_tile.num_warps, launch_pdl=pdl)
    _down_gemv_kernel[(tokens, triton.cdiv(hidden, down_tile.block_n))](
        h, down_w, down_scale if fp8 else down, ids, routing, out, hidden, inter,
        h.stride(0), down.stride(0), down.stride(1), down_scale.stride(0) if fp8 else 0, out.stride(0),
        TOP_K=top_k, W_FP8=fp8, BLOCK_N=down_tile.block_n, BLOCK_K=down_tile.block_k, PDL=pdl,
        num_warps=down_tile.num_warps, launch_pdl=pdl)
    return out
