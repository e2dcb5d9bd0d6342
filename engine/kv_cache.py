"""Paged KV cache: the block pool (BlockManager) and the per-layer cache tensors."""

from __future__ import annotations

from collections import deque

import torch

from engine.models.config import ModelArgs
from engine.request import Sequence

# Block 0 is never handed out: padded rows of a CUDA-graph batch and the steps a
# sequence runs past its end write their K/V there.
DUMMY_BLOCK = 0


class BlockManager:
    """Fixed-size blocks with reference counts; sequences own lists of block ids."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.ref_counts[DUMMY_BLOCK] = 1
        self.free_blocks: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that its first `num_tokens` token slots exist."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq.block_table to cover `num_tokens` slots. Caller checked can_allocate."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * element


def allocate_kv_cache(args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (2, args.num_layers, num_blocks, block_size, args.num_kv_heads, args.head_dim)
    pool = torch.zeros(shape, dtype=dtype, device=device)
    return [(pool[0, i], pool[1, i]) for i in range(args.num_layers)]
