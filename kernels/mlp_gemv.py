"""A decoder MLP at one row in one kernel: gate_up with SiLU-and-mul, then down, with no grid barrier.

Each program takes a slice of the intermediate features, R at a time: it computes their gate and up
values from the whole input row, the SiLU-and-mul, and their share of the output, act[slice] @
down[:, slice].T, from the same slice of down stored transposed (down_t [I, H], so a program's rows
are contiguous). Every program then holds a partial of the whole output row in float32; the last of
each group of GROUP programs to finish sums its group's partials, and the last group sums the group
sums and writes the output (kernels/_split_counters.py), always in index order, so the result does
not depend on which program finishes last. Two kernels (and their boundary) become one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import use_pdl
from kernels.gemv import _x_tile, gemv_ref
from kernels._pdl import wait_for_previous_kernel
from kernels._prefetch import prefetch_l2
from kernels._split_counters import last_to_arrive, split_counters


@triton.jit
def _split_mlp_kernel(
    x_ptr, res_ptr, norm_w_ptr, res_out_ptr, gate_up_ptr, down_t_ptr, part_ptr, group_part_ptr, out_ptr, counter_ptr,
    K, INTER, num_programs, num_groups, eps,
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    R: tl.constexpr,
    CHUNKS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    REDUCE_COLS: tl.constexpr,
    PREFETCH_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """x [K], gate_up [2 * INTER, K], down_t [INTER, K] -> out [K]; program p covers intermediate
    features [p * CHUNKS * R, (p + 1) * CHUNKS * R). HAS_NORM: the MLP's input is RMSNorm(x (+ residual)),
    as kernels/gemv.py fuses it (program 0 stores the new residual)."""
    pid = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    offs_r = tl.arange(0, R)
    first = pid * (CHUNKS * R)
    end = tl.minimum(first + CHUNKS * R, INTER)
    rows = first + offs_r
    mask = (rows < end)[:, None] & k_mask[None, :]
    # the weights do not depend on the kernel before: the first chunk's are read before the wait
    gate_w = tl.load(gate_up_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
    up_w = tl.load(gate_up_ptr + (rows + INTER).to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
    down_w = tl.load(down_t_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
    if PREFETCH_ROWS:  # the later chunks' weights asked of L2 too, so the loop waits on L2, not DRAM
        lines = tl.arange(0, BLOCK_K // 64) * 64  # a 128-byte line every 64 bf16
        later = tl.minimum(first + R + tl.arange(0, PREFETCH_ROWS), INTER - 1).to(tl.int64)
        line_ptrs = later[:, None] * K + tl.minimum(lines, K - 1)[None, :]
        prefetch_l2(gate_up_ptr + line_ptrs)
        prefetch_l2(gate_up_ptr + INTER * K + line_ptrs)
        prefetch_l2(down_t_ptr + line_ptrs)
    if PDL:
        wait_for_previous_kernel()
    inv_rms = 1.0
    if HAS_NORM:
        h = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h = (h + tl.load(res_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(h * h, 0) / K + eps)
    x = _x_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, offs_k, k_mask, inv_rms, tl.where(pid == 0, K, 0),
                HAS_NORM, HAS_RESIDUAL)
    part = tl.zeros([BLOCK_K], dtype=tl.float32)
    for c in range(CHUNKS):
        gate = tl.sum(gate_w.to(tl.float32) * x[None, :], 1).to(dt).to(tl.float32)
        up = tl.sum(up_w.to(tl.float32) * x[None, :], 1).to(dt).to(tl.float32)
        act = ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt).to(tl.float32)
        part += tl.sum(down_w.to(tl.float32) * act[:, None], 0)
        rows = first + (c + 1) * R + offs_r
        mask = (rows < end)[:, None] & k_mask[None, :]
        gate_w = tl.load(gate_up_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        up_w = tl.load(gate_up_ptr + (rows + INTER).to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask,
                       other=0.0)
        down_w = tl.load(down_t_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
    tl.store(part_ptr + pid * K + offs_k, part, mask=k_mask)

    group = pid // GROUP
    group_first = group * GROUP
    in_group = tl.minimum(GROUP, num_programs - group_first)
    if last_to_arrive(counter_ptr + group, in_group):
        # each level reads its partials as one tile (all loads in flight at once), summed in index order
        offs_g = tl.arange(0, GROUP)
        for c0 in tl.static_range(0, BLOCK_K, REDUCE_COLS):
            cols = c0 + tl.arange(0, REDUCE_COLS)
            tile = tl.load(part_ptr + (group_first + offs_g)[:, None] * K + cols[None, :],
                           mask=(offs_g < in_group)[:, None] & (cols < K)[None, :], other=0.0, cache_modifier=".cg")
            tl.store(group_part_ptr + group * K + cols, tl.sum(tile, 0), mask=cols < K)
        if last_to_arrive(counter_ptr + num_groups, num_groups):
            offs_p = tl.arange(0, GROUPS_PAD)
            for c0 in tl.static_range(0, BLOCK_K, REDUCE_COLS):
                cols = c0 + tl.arange(0, REDUCE_COLS)
                sums = tl.load(group_part_ptr + offs_p[:, None] * K + cols[None, :],
                               mask=(offs_p < num_groups)[:, None] & (cols < K)[None, :], other=0.0,
                               cache_modifier=".cg")
                tl.store(out_ptr + cols, tl.sum(sums, 0).to(dt), mask=cols < K)


def split_mlp(x: torch.Tensor, gate_up: torch.Tensor, down_t: torch.Tensor, *,
              norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 1e-6,
              rows_per_chunk: int = 4, chunks: int = 8, group: int = 8, prefetch: bool = True,
              reduce_cols: int = 256, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [1, K], gate_up [2I, K], down_t [I, K] (down_proj's weight transposed, contiguous) -> (out [1, K],
    the new residual x + residual when one is given). norm_weight: the MLP's input is RMSNorm(x (+ residual))."""
    k = x.shape[1]
    inter = down_t.shape[0]
    if group & (group - 1):
        raise ValueError(f"group must be a power of 2, got {group}")
    if x.shape[0] != 1 or gate_up.shape != (2 * inter, k) or down_t.shape != (inter, k):
        raise ValueError(f"expected x [1, K], gate_up [2I, K], down_t [I, K], got {tuple(x.shape)}, "
                         f"{tuple(gate_up.shape)}, {tuple(down_t.shape)}")
    programs = triton.cdiv(inter, rows_per_chunk * chunks)
    groups = triton.cdiv(programs, group)
    counters = split_counters(x.device, "split_mlp", groups + 1)
    if counters is None:
        raise RuntimeError("split_mlp needs its counters allocated before a CUDA-graph capture")
    part = torch.empty(programs, k, dtype=torch.float32, device=x.device)
    group_part = torch.empty(groups, k, dtype=torch.float32, device=x.device)
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError("residual needs norm_weight and the shape of x")
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else None
    pdl = use_pdl(x.device)
    _split_mlp_kernel[(programs,)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        new_residual if new_residual is not None else out,
        gate_up, down_t, part, group_part, out, counters, k, inter, programs, groups, eps,
        HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, R=rows_per_chunk, CHUNKS=chunks, GROUP=group,
        GROUPS_PAD=triton.next_power_of_2(groups), REDUCE_COLS=min(reduce_cols, triton.next_power_of_2(k)),
        PREFETCH_ROWS=triton.next_power_of_2((chunks - 1) * rows_per_chunk) if prefetch and chunks > 1 and x.is_cuda else 0,
        BLOCK_K=triton.next_power_of_2(k), PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl)
    return out, new_residual


def split_mlp_ref(x: torch.Tensor, gate_up: torch.Tensor, down_t: torch.Tensor, *,
                  norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same in torch: the input and intermediate rounded as kernels/gemv.py's fused RMSNorm and
    SiLU-and-mul round them, the output summed in float32 and rounded once."""
    act, new_residual = gemv_ref(x, gate_up, norm_weight=norm_weight, residual=residual, eps=eps, silu_mul=True)
    return (act.float() @ down_t.float()).to(x.dtype), new_residual
