"""The routed-experts MLP of Qwen3-MoE and Mixtral on the GPU: route, align, two grouped GEMMs, combine.

    out[t] = sum over token t's k picks (expert e, weight w) of w * down_e(silu(gate_e x_t) * up_e x_t)

1. route(): float32 softmax of the router logits, torch.topk, optional renormalization -- the
   routing of engine/models/moe/sparse.py's torch path (CPU) and of the reference; here the same in one
   kernel, kernels/moe_route.py's route_fused (ties to the lowest expert id, the set CUDA's
   torch.topk picks).
2. moe_align() (kernels/moe_align.py): the T*k picks (pick p = token p // k, its p % k-th choice)
   grouped by expert and each expert's run padded to a multiple of block_m with a sentinel pick
   (T*k), so every block of block_m picks belongs to one expert; static sizes, no host sync.
3. _expert_gemm_kernel, one program per (block of picks, tile of block_n outputs): the weight tile
   of the block's expert times the block's rows, on the tensor cores as (weights) @ (rows).T ("swap
   AB": the weights fill the wide side, the picks -- as few as 1 -- the narrow one, >= 16).
   - gate_up: rows gathered from x (token of each pick), gate and up tiles both read, SiLU-and-mul
     in the epilogue (rounded as the unfused path rounds), into h [padded picks, I];
   - down: rows of h, each output times its pick's routing weight, into the pick's own row of
     [T*k, H] (sentinel rows not stored).
   Blocks past the padded length (their count is known on the device only) return at once.
   Programs are ordered blocks-fastest, so the blocks of one expert that share a weight tile run
   together and read it from L2 once.
4. combine (_combine_kernel): the [T, k, H] per-pick rows summed over k in float32, in pick order,
   rounded once -- deterministic, no atomics, one kernel (torch's sum and cast were three).

Decode steps of up to GEMV_MAX_TOKENS tokens skip 2-4 for kernels/moe_gemv.py's two matrix-vector kernels
(no alignment, the combine fused into the down projection).

Small batches (T <= 16): block_m = 16 >= T, and an expert is picked at most once a token,
so each chosen expert's picks fit one block: every selected expert's weights are read exactly once
(a GEMV-like pass over the chosen experts, bandwidth-bound), with narrow output tiles so the few
experts still give every SM programs. Larger T (prefill, large decode batches): block_m up to 64 from
the average picks an expert, wide tiles. Launch parameters depend on shapes only.

FP8 experts (`--quantization fp8`): gate_up and down in float8 e4m3 with one float32 scale per
output channel per expert ([E, 2I] and [E, H], engine/models/fp8.py's layout). Weight-only: each
weight tile is widened in registers (to fp16 beside bf16 / fp16 rows, which are scaled by 2^-8
into fp16's range as kernels/skinny_gemm.py's weight-only path does; to fp32 beside fp32 rows),
the product accumulates in float32 and the epilogue multiplies each output channel by its scale.
The weights are read at half the bytes, the activations stay unrounded. W_FP8 is a constexpr: the
bf16 path compiles as before.
fused_moe_ref is the float32 torch reference (FP8 weights dequantized).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import dot_precision, sm_count
from graphserve.kernels.moe_align import moe_align
from graphserve.kernels.moe_gemv import GEMV_MAX_TOKENS, default_gemv_tiles, experts_gemv
from graphserve.kernels.moe_route import route_fused
from graphserve.kernels.skinny_gemm import W_ONLY_X_SCALE

FP8 = torch.float8_e4m3fn


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T, k] float32, expert ids [T, k] int64) from router logits [T, E]: the
    top k of a float32 softmax (ties broken as torch.topk, as transformers does), scaled to sum to 1
    where renormalize (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_picks_ptr, block_experts_ptr, num_padded_ptr, routing_ptr,
    N, K, num_picks,
    stride_a, stride_we, stride_wn, stride_se, stride_o,
    TOP_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    W_FP8: tl.constexpr,
    A_TO_FP16: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """SILU_MUL (gate_up): a = x [T, K], w = gate_up [E, 2N, K]; out = h [padded, N] at the block's
    padded rows. Otherwise (down): a = h, w = down [E, N, K]; out [T*k, N] at each pick's row, times
    its routing weight. W_FP8: w is float8 e4m3 with float32 scales w_scale [E, rows of w] (row
    stride stride_se), widened in registers (A_TO_FP16: to fp16, a scaled by W_ONLY_X_SCALE into
    fp16; else to a's dtype) and the accumulator scaled per output channel."""
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # padded positions
    picks = tl.load(sorted_picks_ptr + offs_m)
    real = picks < num_picks
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if SILU_MUL:
        a_rows = (picks // TOP_K).to(tl.int64)  # each pick's token
    else:
        a_rows = offs_m.to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SILU_MUL:  # up row N + n beside gate row n
        u_ptrs = w_ptrs + N * stride_wn
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=real[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if W_FP8:
            if A_TO_FP16:  # e4m3 is exact in fp16 (a native conversion, unlike bf16's)
                a = (a.to(tl.float32) * W_ONLY_X_SCALE).to(tl.float16)
                w = w.to(tl.float16)
            else:
                w = w.to(a.dtype)
        acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PREC)
        if SILU_MUL:
            u = tl.load(u_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if W_FP8:
                u = u.to(a.dtype)
            acc_u = tl.dot(u, tl.trans(a), acc_u, input_precision=DOT_PREC)
            u_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if W_FP8:  # per output channel; undoes a's scaling into fp16
        s_ptrs = w_scale_ptr + expert * stride_se + offs_n
        scale = tl.load(s_ptrs, mask=n_mask, other=0.0)
        if A_TO_FP16:
            scale = scale / W_ONLY_X_SCALE
        acc = acc * scale[:, None]
        if SILU_MUL:
            scale_u = tl.load(s_ptrs + N, mask=n_mask, other=0.0)
            if A_TO_FP16:
                scale_u = scale_u / W_ONLY_X_SCALE
            acc_u = acc_u * scale_u[:, None]
    dt = out_ptr.dtype.element_ty
    if SILU_MUL:  # rounded as the unfused path rounds (kernels/activation.py)
        gate = acc.to(dt).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
        o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
        tl.store(o_ptrs, y.to(dt), mask=n_mask[:, None])
    else:
        weight = tl.load(routing_ptr + picks, mask=real, other=0.0)
        o_ptrs = out_ptr + picks.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
        tl.store(o_ptrs, (acc * weight[None, :]).to(dt), mask=n_mask[:, None] & real[None, :])


class MoeTile(NamedTuple):
    """One grouped GEMM's launch shape: picks a block (shared by both GEMMs: the alignment's
    block_m), outputs and K elements a program, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Up to this many tokens each chosen expert's picks fit one block of 16 (the smallest tl.dot side),
# so its weights are read once: the small-batch (decode) path.
SMALL_BATCH_MAX_TOKENS = 16


def default_moe_tiles(tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, num_sms: int,
                      elem_bytes: int = 2) -> tuple[MoeTile, MoeTile]:
    """(gate_up tile, down tile), untuned first choices (issue 41 asks for a sweep). Small batches:
    blocks of 16, output tiles narrowed from 64 to 16 until the chosen experts (at most T*k) give
    every SM two programs. Larger: blocks of 16 to 64 (the average picks an expert, rounded up to a
    power of two), 64 (gate_up: two weight tiles) or 128 outputs a program. K tiles of 128 bytes x 2
    (fp32) or 256 bytes, narrowed to the width where it is smaller."""
    picks = tokens * top_k
    block_k = 256 // elem_bytes if elem_bytes <= 2 else 64
    if tokens <= SMALL_BATCH_MAX_TOKENS:
        block_m = 16
        experts_used = min(num_experts, picks)
        tiles = []
        for n in (inter, hidden):
            block_n = 64
            while block_n > 16 and experts_used * triton.cdiv(n, block_n) < 2 * num_sms:
                block_n //= 2
            tiles.append((block_n, 4))
    else:
        block_m = min(64, max(16, triton.next_power_of_2(triton.cdiv(picks, num_experts))))
        tiles = [(64, 3), (128, 3)]
    return tuple(MoeTile(block_m, min(block_n, max(16, triton.next_power_of_2(n))),
                         min(block_k, max(16, triton.next_power_of_2(k))), 4, stages)
                 for (block_n, stages), n, k in zip(tiles, (inter, hidden), (hidden, inter)))


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    tiles: tuple[MoeTile, MoeTile] | None = None,
    gemv: bool | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] for x [T, H] (bf16 / fp16 / fp32), router_logits
    [T, E], gate_up [E, 2I, H] (each expert's [gate; up] rows) and down [E, H, I] of x's dtype, or
    float8 e4m3 with gate_up_scale [E, 2I] and down_scale [E, H] float32 (one per output channel);
    float32 accumulation. tiles: (gate_up, down) launch shapes of the grouped path with one block_m
    (benchmark sweeps); gemv: the decode path (kernels/moe_gemv.py) forced on or off, None: up to
    GEMV_MAX_TOKENS tokens."""
    weights, expert_ids = route_fused(router_logits, top_k, renormalize)
    return fused_experts(x, weights, expert_ids, gate_up, down, gate_up_scale=gate_up_scale, down_scale=down_scale,
                         tiles=tiles, gemv=gemv)


def _check_fp8_scales(gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None,
                      down_scale: torch.Tensor | None) -> bool:
    """Whether the experts are FP8 (then with well-formed scales), or ValueError."""
    fp8 = gate_up.dtype == FP8
    if fp8 != (down.dtype == FP8) or fp8 != (gate_up_scale is not None) or fp8 != (down_scale is not None):
        raise ValueError("FP8 experts need gate_up and down both float8 e4m3, with gate_up_scale and down_scale "
                         "(and scales go with FP8 weights only)")
    if fp8:
        for scale, w in ((gate_up_scale, gate_up), (down_scale, down)):
            if scale.shape != w.shape[:2] or scale.dtype != torch.float32 or not scale.is_contiguous():
                raise ValueError(f"expected a contiguous float32 scale {tuple(w.shape[:2])} per expert and output "
                                 f"channel, got {scale.dtype} {tuple(scale.shape)}")
    return fp8


def fused_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, *, gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None,
                  tiles: tuple[MoeTile, MoeTile] | None = None, gemv: bool | None = None) -> torch.Tensor:
    """fused_moe after routing: weights [T, k] float32 and expert_ids [T, k] from route()."""
    if x.dim() != 2 or gate_up.dim() != 3 or expert_ids.shape != weights.shape or expert_ids.dim() != 2:
        raise ValueError(f"expected x [T, H], gate_up [E, 2I, H] and routing [T, k], got x {tuple(x.shape)}, "
                         f"gate_up {tuple(gate_up.shape)}, routing {tuple(expert_ids.shape)}")
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter, top_k = two_inter // 2, expert_ids.shape[1]
    fp8 = _check_fp8_scales(gate_up, down, gate_up_scale, down_scale)
    if (gate_up.shape != (num_experts, 2 * inter, hidden) or down.shape != (num_experts, hidden, inter)
            or not (fp8 or x.dtype == gate_up.dtype == down.dtype) or expert_ids.shape[0] != tokens):
        raise ValueError(f"expected x [T, H], gate_up [E, 2I, H], down [E, H, I] of one dtype (or FP8) and routing "
                         f"[T, k], got x {x.dtype} {tuple(x.shape)}, gate_up {gate_up.dtype} {tuple(gate_up.shape)}, "
                         f"down {down.dtype} {tuple(down.shape)}, routing {tuple(expert_ids.shape)}")
    if x.stride(1) != 1 or not gate_up.is_contiguous() or not down.is_contiguous():
        raise ValueError("x needs contiguous rows, gate_up and down must be contiguous")
    if tokens == 0:
        return torch.zeros_like(x)
    use_gemv = gemv if gemv is not None else tiles is None and tokens <= GEMV_MAX_TOKENS
    if use_gemv:
        return experts_gemv(x, weights, expert_ids, gate_up, down, gate_up_scale, down_scale,
                            default_gemv_tiles(tokens, top_k, hidden, inter, sm_count(x.device), gate_up.element_size()))
    gate_up_tile, down_tile = tiles or default_moe_tiles(tokens, top_k, num_experts, hidden, inter,
                                                         sm_count(x.device), x.element_size())
    if gate_up_tile.block_m != down_tile.block_m:
        raise ValueError("both GEMMs' tiles need the same block_m (the alignment's)")
    aligned = moe_align(expert_ids, num_experts, gate_up_tile.block_m)
    num_blocks = aligned.block_experts.shape[0]
    num_picks = tokens * top_k
    h = torch.empty((aligned.sorted_picks.shape[0], inter), dtype=x.dtype, device=x.device)
    per_pick = torch.empty((num_picks, hidden), dtype=x.dtype, device=x.device)
    routing = weights.reshape(-1).contiguous()
    precision = dot_precision(x.dtype)
    to_fp16 = fp8 and x.dtype in (torch.bfloat16, torch.float16)
    for a, w, w_scale, out, n, k, tile, silu_mul in (
            (x, gate_up, gate_up_scale, h, inter, hidden, gate_up_tile, True),
            (h, down, down_scale, per_pick, hidden, inter, down_tile, False)):
        w_scale = w if w_scale is None else w_scale  # a pointer the bf16 path never reads
        _expert_gemm_kernel[(num_blocks, triton.cdiv(n, tile.block_n))](
            a, w, w_scale, out, aligned.sorted_picks, aligned.block_experts, aligned.num_padded, routing,
            n, k, num_picks,
            a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), out.stride(0),
            TOP_K=top_k, SILU_MUL=silu_mul, W_FP8=fp8, A_TO_FP16=to_fp16, DOT_PREC=precision,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
    out = torch.empty_like(x)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block_h))](per_pick, out, hidden, TOP_K=top_k, BLOCK_H=block_h)
    return out


@triton.jit
def _combine_kernel(per_pick_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = the sum over token t's k picks' rows of per_pick [T*k, H], in float32 and pick order
    (the order torch's sum over the k dim takes), rounded once to out's dtype."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(per_pick_ptr + (token * TOP_K + j) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe_ref(x: torch.Tensor, router_logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  top_k: int, renormalize: bool, gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 reference (host-synchronizing): each chosen expert over its tokens, in float32,
    weighted and added into their rows. FP8 experts come with their scales and are dequantized."""
    weights, expert_ids = route(router_logits, top_k, renormalize)
    xf = x.float()
    out = torch.zeros_like(xf)
    for expert in expert_ids.unique().tolist():
        tokens, slots = (expert_ids == expert).nonzero(as_tuple=True)
        w_gate_up, w_down = gate_up[expert].float(), down[expert].float()
        if gate_up_scale is not None:
            w_gate_up = w_gate_up * gate_up_scale[expert, :, None].float()
            w_down = w_down * down_scale[expert, :, None].float()
        gate, up = (xf[tokens] @ w_gate_up.T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w_down.T
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out
