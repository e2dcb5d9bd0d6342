"""The picks of a mixture-of-experts layer sorted and padded to blocks per expert, for the grouped GEMMs
of kernels/moe.py.

The T*k picks (pick p = token p // k, its p % k-th choice) are grouped by expert (ascending, picks in
order within an expert) and each expert's run is padded to a multiple of block_m with a sentinel pick
(T*k), so every block of block_m picks belongs to one expert. No host sync, and every size is fixed by
(T, k, E, block_m), so a CUDA graph captures it: a run of c picks pads to ceil(c / block_m) blocks, and
at most min(E, T*k) experts have picks, so T*k + min(E, T*k) * (block_m - 1) bounds the padded length
(the buffers' size; how much of it a routing uses is known on the device only).

Up to ALIGN_KERNEL_MAX_PICKS picks (decode batches) it is one Triton program -- one-hot counts and
prefix sums over chunks of picks, no sort -- since in a decode graph the ~20 small torch ops of the
sort-based version cost more in launches than their work; past it, those torch ops (moe_align_torch,
also the kernel's reference: both give the same result).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class AlignedPicks(NamedTuple):
    """moe_align's result. sorted_picks [padded_size] int32: pick ids grouped by expert, each
    expert's run padded to whole blocks with the sentinel T*k (also past the end); block_experts
    [padded_size // block_m] int32: each block's expert, -1 past num_padded; num_padded [1] int32:
    the padded length actually used (on the device)."""

    sorted_picks: torch.Tensor
    block_experts: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def max_padded_picks(num_picks: int, num_experts: int, block_m: int) -> int:
    """The static length of moe_align's sorted_picks: a whole number of blocks that holds any routing."""
    bound = num_picks + min(num_experts, num_picks) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


# Up to this many picks (T * k) moe_align runs as one Triton program; past it the torch ops, whose
# sort grows slower than the one program's passes over the picks. Not measured yet.
ALIGN_KERNEL_MAX_PICKS = 4096


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPicks:
    """Picks [T, k] (expert ids) grouped by expert and padded to blocks of block_m picks of one
    expert each, without a host sync: one Triton program up to ALIGN_KERNEL_MAX_PICKS picks, torch
    ops past it; both give the same result."""
    if expert_ids.numel() > ALIGN_KERNEL_MAX_PICKS:
        return moe_align_torch(expert_ids, num_experts, block_m)
    num_picks, device = expert_ids.numel(), expert_ids.device
    padded_size = max_padded_picks(num_picks, num_experts, block_m)
    sorted_picks = torch.empty(padded_size, dtype=torch.int32, device=device)
    block_experts = torch.empty(padded_size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](
        expert_ids.reshape(-1), sorted_picks, block_experts, num_padded, num_picks, num_experts, padded_size,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=max(16, 4096 // block_e),
        BLOCKS_CHUNK=max(1, 4096 // max(block_e, block_m)), num_warps=8,
    )
    return AlignedPicks(sorted_picks, block_experts, num_padded, block_m)


@triton.jit
def _moe_align_kernel(expert_ids_ptr, sorted_picks_ptr, block_experts_ptr, num_padded_ptr,
                      num_picks, num_experts, padded_size,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCKS_CHUNK: tl.constexpr):
    """moe_align_torch in one program, passes over [CHUNK, BLOCK_E] one-hot tiles (no sort): count each
    expert's picks; place each pick at its expert's padded start + the picks of that expert before it;
    then, BLOCKS_CHUNK blocks at a time, each block's expert and the sentinel in every slot no pick
    took (slots disjoint from the picks' own: no ordering between the two passes' stores)."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_picks, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        e = tl.load(expert_ids_ptr + offs, mask=offs < num_picks, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    num_padded = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, num_padded)

    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_picks, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        e = tl.load(expert_ids_ptr + offs, mask=offs < num_picks, other=-1)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        place = starts[None, :] + seen[None, :] + tl.cumsum(onehot, axis=0) - 1
        tl.store(sorted_picks_ptr + tl.sum(onehot * place, axis=1), offs, mask=offs < num_picks)
        seen += tl.sum(onehot, axis=0)

    num_blocks = padded_size // BLOCK_M
    filled_ends = starts + counts
    for b0 in range(0, num_blocks, BLOCKS_CHUNK):
        blocks = b0 + tl.arange(0, BLOCKS_CHUNK)
        first = blocks * BLOCK_M
        # the expert whose padded run holds the block (BLOCK_E past the used ones: no expert)
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        owner_onehot = (owner[:, None] == experts[None, :]).to(tl.int32)
        filled_end = tl.sum(owner_onehot * filled_ends[None, :], axis=1)
        in_range = blocks < num_blocks
        tl.store(block_experts_ptr + blocks, tl.where(first < num_padded, owner, -1), mask=in_range)
        slots = first[:, None] + tl.arange(0, BLOCK_M)[None, :]
        sentinel = tl.full([BLOCKS_CHUNK, BLOCK_M], 0, tl.int32) + num_picks
        tl.store(sorted_picks_ptr + slots, sentinel, mask=in_range[:, None] & (slots >= filled_end[:, None]))


def moe_align_torch(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPicks:
    """moe_align in torch ops (a stable sort): the large-batch path, and the kernel's reference."""
    picks = expert_ids.reshape(-1).to(torch.int64)
    num_picks, device = picks.numel(), picks.device
    padded_size = max_padded_picks(num_picks, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, picks, torch.ones_like(picks))  # not bincount: on CUDA it syncs for its size
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    padded_starts = padded_ends - padded_counts
    starts = counts.cumsum(0) - counts
    order = torch.sort(picks, stable=True).indices
    sorted_experts = picks[order]
    rank = torch.arange(num_picks, device=device) - starts[sorted_experts]
    sorted_picks = torch.full((padded_size,), num_picks, dtype=torch.int32, device=device)
    sorted_picks.scatter_(0, padded_starts[sorted_experts] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, padded_size, block_m, device=device)
    num_padded = padded_ends[-1:]
    # the expert whose padded run holds the block's first pick: the first whose run ends past it
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_starts < num_padded, block_experts, -1).to(torch.int32)
    return AlignedPicks(sorted_picks, block_experts, num_padded.to(torch.int32), block_m)
