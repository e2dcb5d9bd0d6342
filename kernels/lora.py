"""LoRA's product on CUDA: each row adds its adapter's scale * B @ (A @ x) to a projection's output,
the adapter picked per row by its slot (-1: none), in two kernels (Punica's shrink and expand):

- shrink: u = A[slot, slice] @ x, rank-wide, split over the input dim; each split writes its partial
  sums (no atomics, no zeroing), which expand adds up as it reads them;
- expand: y[:, slice] += scale[slot] * B[slot, slice rows] @ u, in place.

Two forms of each. Rows (decode; a CUDA graph's static batch): one program per row and slice, which
gathers its own adapter's weights; a padded or base row (-1) returns at once. Segments (prefill):
a tile map of (first row, end row, slot), BLOCK_M rows of one sequence per tile, through tl.dot.
The weights are slot-stacked: A [S, slices, R, K] and B [S, N, R] with R the maximum rank; ranks
[S, slices] give each slot's rank per slice (0: the adapter leaves that slice alone), so a rank-8
adapter in rank-64 slots reads 8 rows of A and 8 columns of B. lora_add_ref is the torch reference."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import dot_precision

SEGMENT_ROWS = 32  # rows of one tile of a segment (prefill); kernels/lora.py's tile maps are cut by it
_BLOCK_K = 128
_BLOCK_N = 128


@triton.jit
def _slice_bounds(j, START1, START2, SIZE0, SIZE1, SIZE2):
    start = tl.where(j == 0, 0, tl.where(j == 1, START1, START2))
    size = tl.where(j == 0, SIZE0, tl.where(j == 1, SIZE1, SIZE2))
    return start, size


@triton.jit
def _row_rstd(row_ptr, K, eps, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of one row (the RMSNorm an input goes through before A)."""
    total = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(row_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        total += x * x
    return tl.rsqrt(tl.sum(total) / K + eps)


@triton.jit
def _shrink_rows_kernel(x_ptr, a_ptr, slots_ptr, ranks_ptr, part_ptr, norm_ptr, eps, T, K, k_per_split, stride_x,
                        stride_as, stride_aj, stride_ar, NS: tl.constexpr, NORM: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot * NS + j)
        if rank > 0:
            r = tl.arange(0, BLOCK_R)
            a_rows = a_ptr + slot * stride_as + j * stride_aj + r[:, None] * stride_ar
            x_row = x_ptr + t.to(tl.int64) * stride_x
            rstd = _row_rstd(x_row, K, eps, BLOCK_K) if NORM else 1.0
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            k_begin = split * k_per_split
            k_end = tl.minimum(k_begin + k_per_split, K)
            for k0 in range(k_begin, k_end, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < k_end
                x = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
                if NORM:
                    x = x * rstd * tl.load(norm_ptr + k, mask=kmask, other=0.0).to(tl.float32)
                a = tl.load(a_rows + k[None, :], mask=(r[:, None] < rank) & kmask[None, :], other=0.0)
                acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
            tl.store(part_ptr + ((split * T + t) * NS + j) * BLOCK_R + r, acc)


@triton.jit
def _expand_rows_kernel(y_ptr, b_ptr, slots_ptr, ranks_ptr, scales_ptr, part_ptr, T, num_splits, stride_y,
                        stride_bs, stride_bn, START1, START2, SIZE0, SIZE1, SIZE2, NS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot * NS + j)
        start, size = _slice_bounds(j, START1, START2, SIZE0, SIZE1, SIZE2)
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        if (rank > 0) & (tl.program_id(2) * BLOCK_N < size):
            r = tl.arange(0, BLOCK_R)
            rmask = r < rank
            u = tl.zeros([BLOCK_R], dtype=tl.float32)
            for s in range(num_splits):
                u += tl.load(part_ptr + ((s * T + t) * NS + j) * BLOCK_R + r, mask=rmask, other=0.0)
            nmask = n < size
            b = tl.load(b_ptr + slot * stride_bs + (start + n)[:, None] * stride_bn + r[None, :],
                        mask=nmask[:, None] & rmask[None, :], other=0.0)
            delta = tl.sum(b.to(tl.float32) * u[None, :], axis=1) * tl.load(scales_ptr + slot)
            out = y_ptr + t.to(tl.int64) * stride_y + start + n
            y = tl.load(out, mask=nmask, other=0.0)
            tl.store(out, (y.to(tl.float32) + delta).to(y.dtype), mask=nmask)


@triton.jit
def _half_plus_delta(y_row, b_ptr, ranks_ptr, scales_ptr, part_ptr, slot, has, t, T, num_splits, j, n, nmask, I,
                     stride_bs, stride_bn, BLOCK_R: tl.constexpr):
    """Slice j (gate or up) of one row of a gate_up output plus the row's adapter product, rounded to y's dtype
    (as the unfused path stores it before the SiLU reads it), in float32."""
    r = tl.arange(0, BLOCK_R)
    rank = tl.where(has, tl.load(ranks_ptr + slot * 2 + j), 0)
    rmask = r < rank
    u = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in range(num_splits):
        u += tl.load(part_ptr + ((s * T + t) * 2 + j) * BLOCK_R + r, mask=rmask, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + (j * I + n)[:, None] * stride_bn + r[None, :],
                mask=nmask[:, None] & rmask[None, :], other=0.0)
    delta = tl.sum(b.to(tl.float32) * u[None, :], axis=1) * tl.load(scales_ptr + slot)
    y = tl.load(y_row + j * I + n, mask=nmask, other=0.0)
    return (y.to(tl.float32) + delta).to(y.dtype).to(tl.float32)


@triton.jit
def _expand_rows_silu_kernel(y_ptr, out_ptr, b_ptr, slots_ptr, ranks_ptr, scales_ptr, part_ptr, T, num_splits,
                             stride_y, stride_o, stride_bs, stride_bn, I, BLOCK_R: tl.constexpr,
                             BLOCK_N: tl.constexpr):
    """A gate_up projection's expand and SiLU-and-mul in one: out[:, n] = silu(gate + delta) * (up + delta)
    for columns n of both slices, every row (one without an adapter adds nothing)."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    slot = tl.load(slots_ptr + t).to(tl.int64)
    has = slot >= 0
    slot = tl.maximum(slot, 0)
    y_row = y_ptr + t.to(tl.int64) * stride_y
    gate = _half_plus_delta(y_row, b_ptr, ranks_ptr, scales_ptr, part_ptr, slot, has, t, T, num_splits, 0, n, nmask,
                            I, stride_bs, stride_bn, BLOCK_R)
    up = _half_plus_delta(y_row, b_ptr, ranks_ptr, scales_ptr, part_ptr, slot, has, t, T, num_splits, 1, n, nmask,
                          I, stride_bs, stride_bn, BLOCK_R)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, (act * up).to(dtype), mask=nmask)


@triton.jit(do_not_specialize=["T"])  # one compiled variant whatever the prefill's length
def _shrink_segments_kernel(x_ptr, a_ptr, tiles_ptr, ranks_ptr, part_ptr, norm_ptr, eps, T, K, k_per_split,
                            stride_x, stride_as, stride_aj, stride_ar, NS: tl.constexpr, NORM: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                            PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    j = tl.program_id(1)
    split = tl.program_id(2)
    first = tl.load(tiles_ptr + tile * 3)
    end = tl.load(tiles_ptr + tile * 3 + 1)
    slot = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot * NS + j)
        if rank > 0:
            m = first + tl.arange(0, BLOCK_M)
            mmask = m < end
            r = tl.arange(0, BLOCK_R)
            x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_x
            if NORM:
                total = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    xf = tl.load(x_rows + k[None, :], mask=mmask[:, None] & (k < K)[None, :], other=0.0)
                    total += xf.to(tl.float32) * xf.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(total, axis=1) / K + eps)
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            k_begin = split * k_per_split
            k_end = tl.minimum(k_begin + k_per_split, K)
            for k0 in range(k_begin, k_end, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < k_end
                x = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
                if NORM:
                    w = tl.load(norm_ptr + k, mask=kmask, other=0.0).to(tl.float32)
                    x = (x.to(tl.float32) * rstd[:, None] * w[None, :]).to(x.dtype)
                a = tl.load(a_ptr + slot * stride_as + j * stride_aj + r[None, :] * stride_ar + k[:, None],
                            mask=(r[None, :] < rank) & kmask[:, None], other=0.0)
                acc = tl.dot(x, a.to(x.dtype), acc, input_precision=PRECISION)
            tl.store(part_ptr + ((split * T + m[:, None]) * NS + j) * BLOCK_R + r[None, :], acc,
                     mask=mmask[:, None])


@triton.jit(do_not_specialize=["T"])
def _expand_segments_kernel(y_ptr, b_ptr, tiles_ptr, ranks_ptr, scales_ptr, part_ptr, T, num_splits, stride_y,
                            stride_bs, stride_bn, START1, START2, SIZE0, SIZE1, SIZE2, NS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                            PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    j = tl.program_id(1)
    first = tl.load(tiles_ptr + tile * 3)
    end = tl.load(tiles_ptr + tile * 3 + 1)
    slot = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot * NS + j)
        start, size = _slice_bounds(j, START1, START2, SIZE0, SIZE1, SIZE2)
        if (rank > 0) & (tl.program_id(2) * BLOCK_N < size):
            m = first + tl.arange(0, BLOCK_M)
            mmask = m < end
            r = tl.arange(0, BLOCK_R)
            rmask = r < rank
            n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < size
            u = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for s in range(num_splits):
                u += tl.load(part_ptr + ((s * T + m[:, None]) * NS + j) * BLOCK_R + r[None, :],
                             mask=mmask[:, None] & rmask[None, :], other=0.0)
            b = tl.load(b_ptr + slot * stride_bs + (start + n)[None, :] * stride_bn + r[:, None],
                        mask=rmask[:, None] & nmask[None, :], other=0.0)
            delta = tl.dot(u.to(b.dtype), b, input_precision=PRECISION) * tl.load(scales_ptr + slot)
            out = y_ptr + m.to(tl.int64)[:, None] * stride_y + start + n[None, :]
            omask = mmask[:, None] & nmask[None, :]
            y = tl.load(out, mask=omask, other=0.0)
            tl.store(out, (y.to(tl.float32) + delta).to(y.dtype), mask=omask)


def _num_splits(k: int, rows: int | None) -> int:
    """Splits of the input dim: enough programs for a few rows, few partials to add up for many. Segments
    (rows None: a prefill) always split alike, so a prompt's length never compiles another variant."""
    if rows is None or rows >= 64:
        return max(1, min(4, k // 1024))
    return max(1, min(16, k // 512))


def block_rank(max_rank: int) -> int:
    """The rank dim the kernels tile: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(max_rank))


def _check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
           slice_sizes: tuple[int, ...]) -> None:
    if a.dim() != 4 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise ValueError(f"expected A [S, slices, R, K] and B [S, N, R], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != len(slice_sizes) or not 1 <= len(slice_sizes) <= 3 or sum(slice_sizes) != b.shape[1]:
        raise ValueError(f"slices {slice_sizes} do not cover B's {b.shape[1]} rows in {a.shape[1]} slices")
    if x.shape[1] != a.shape[3] or y.shape[1] != b.shape[1] or x.shape[0] != y.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} do not fit A {tuple(a.shape)}, B {tuple(b.shape)}")
    if x.stride(-1) != 1 or y.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("x, y, A and B need a contiguous last dim")
    if tuple(ranks.shape) != (a.shape[0], a.shape[1]) or ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be int32 [S, slices], got {ranks.dtype} {tuple(ranks.shape)}")


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
             scales: torch.Tensor, slice_sizes: tuple[int, ...], slots: torch.Tensor | None = None,
             tiles: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
             silu_mul: bool = False) -> torch.Tensor:
    """y [T, N] += for each row, scale[s] * B[s, slice] @ (A[s, slice] @ x) per slice, s the row's slot:
    slots [T] int32 (-1: none; one program per row: decode) or tiles [NT, 3] int32 (first row, end row,
    slot; segment_tiles: prefill). a [S, slices, R, K], b [S, N, R] (strided over S: a layer's view of
    stacked slots), ranks [S, slices] int32, scales [S] float32. norm (weight [K], eps): x goes through
    that RMSNorm first (the projection's kernel fused it and never showed its input). Returns y, changed
    in place; silu_mul (y is a fused [gate; up]): a new [T, N / 2] silu(gate) * up of the sums."""
    _check(y, x, a, b, ranks, slice_sizes)
    if (slots is None) == (tiles is None):
        raise ValueError("give slots (one per row) or tiles (segments), not both")
    if silu_mul and (len(slice_sizes) != 2 or slice_sizes[0] != slice_sizes[1]):
        raise ValueError(f"silu_mul needs a [gate; up] projection, got slices {slice_sizes}")
    norm_weight, eps = norm if norm is not None else (x, 0.0)  # (unread without NORM)
    rows, k = x.shape
    ns, block_r = len(slice_sizes), a.shape[2]
    if block_r != block_rank(block_r):
        raise ValueError(f"the slots' rank dim {block_r} must be block_rank(max rank)")
    if rows == 0:
        return y[:, :slice_sizes[0]].clone() if silu_mul else y
    splits = _num_splits(k, rows if slots is not None else None)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), _BLOCK_K) * _BLOCK_K
    splits = triton.cdiv(k, k_per_split)
    partials = torch.empty((splits, rows, ns, block_r), dtype=torch.float32, device=x.device)
    sizes = (*slice_sizes, 0, 0)[:3]
    starts = (0, sizes[0], sizes[0] + sizes[1])
    n_blocks = triton.cdiv(max(slice_sizes), _BLOCK_N)
    if slots is not None:
        _shrink_rows_kernel[(rows, ns, splits)](
            x, a, slots, ranks, partials, norm_weight, eps, rows, k, k_per_split, x.stride(0), a.stride(0),
            a.stride(1), a.stride(2), NS=ns, NORM=norm is not None, BLOCK_R=block_r, BLOCK_K=_BLOCK_K, num_warps=4)
        if silu_mul:
            out = torch.empty((rows, slice_sizes[0]), dtype=y.dtype, device=y.device)
            _expand_rows_silu_kernel[(rows, triton.cdiv(slice_sizes[0], _BLOCK_N))](
                y, out, b, slots, ranks, scales, partials, rows, splits, y.stride(0), out.stride(0), b.stride(0),
                b.stride(1), slice_sizes[0], BLOCK_R=block_r, BLOCK_N=_BLOCK_N, num_warps=4)
            return out
        _expand_rows_kernel[(rows, ns, n_blocks)](
            y, b, slots, ranks, scales, partials, rows, splits, y.stride(0), b.stride(0), b.stride(1), starts[1],
            starts[2], *sizes, NS=ns, BLOCK_R=block_r, BLOCK_N=_BLOCK_N, num_warps=4)
        return y
    precision = dot_precision(x.dtype)
    num_tiles = tiles.shape[0]
    _shrink_segments_kernel[(num_tiles, ns, splits)](
        x, a, tiles, ranks, partials, norm_weight, eps, rows, k, k_per_split, x.stride(0), a.stride(0), a.stride(1),
        a.stride(2), NS=ns, NORM=norm is not None, BLOCK_M=SEGMENT_ROWS, BLOCK_R=block_r, BLOCK_K=64,
        PRECISION=precision, num_warps=4)
    _expand_segments_kernel[(num_tiles, ns, n_blocks)](
        y, b, tiles, ranks, scales, partials, rows, splits, y.stride(0), b.stride(0), b.stride(1), starts[1],
        starts[2], *sizes, NS=ns, BLOCK_M=SEGMENT_ROWS, BLOCK_R=block_r, BLOCK_N=64, PRECISION=precision,
        num_warps=4)
    if silu_mul:  # prefill: the SiLU over every row, a kernel of its own
        from graphserve.kernels.activation import silu_and_mul

        return silu_and_mul(y)
    return y


def segment_tiles(segments: list[tuple[int, int, int]], min_tiles: int = 0) -> np.ndarray:
    """The tile map of `segments` (slot, first row, end row), SEGMENT_ROWS rows a tile: [NT, 3] int32 rows
    (first, end, slot); padded to min_tiles with tiles of slot -1 (a CUDA graph's fixed grid)."""
    tiles = [(first, end, slot) for slot, begin, end in segments if slot >= 0
             for first in range(begin, end, SEGMENT_ROWS)]
    tiles += [(0, 0, -1)] * max(0, min_tiles - len(tiles))
    return np.asarray(tiles, dtype=np.int32).reshape(-1, 3)


def tile_rows(tiles: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows] int32: each row's slot under a tile map (-1 where no tile covers it)."""
    slots = torch.full((num_rows,), -1, dtype=torch.int32)
    for first, end, slot in tiles.tolist():
        if slot >= 0:
            slots[first:end] = slot
    return slots


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
                 scales: torch.Tensor, slice_sizes: tuple[int, ...], slots: torch.Tensor | None = None,
                 tiles: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
                 silu_mul: bool = False) -> torch.Tensor:
    """lora_add in torch, row by row, in float32 (the reference of the kernels' tests)."""
    row_slots = slots.tolist() if slots is not None else tile_rows(tiles.cpu(), x.shape[0]).tolist()
    if norm is not None:
        xf = x.float()
        x = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm[1]) * norm[0].float()
    ranks_l, scales_l = ranks.tolist(), scales.tolist()
    starts = np.cumsum((0, *slice_sizes))
    for t, slot in enumerate(row_slots):
        if slot < 0:
            continue
        for j in range(len(slice_sizes)):
            rank = ranks_l[slot][j]
            if rank == 0:
                continue
            u = a[slot, j, :rank].float() @ x[t].float()
            delta = b[slot, starts[j]:starts[j + 1], :rank].float() @ u * scales_l[slot]
            y[t, starts[j]:starts[j + 1]] = (y[t, starts[j]:starts[j + 1]].float() + delta).to(y.dtype)
    if silu_mul:
        gate, up = y.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate).to(y.dtype).float() * up).to(y.dtype)
    return y
