"""The token bitmask of grammar-constrained decoding, unpacked: shared by the sampler and the
greedy kernel's reference. Pure tensor ops, no Triton: it runs inside captured CUDA graphs."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 (bit j of word w: token 32w + j is allowed) -> [B, V] bool."""
    vocab = torch.arange(vocab_size, device=bitmask.device)
    words = bitmask.index_select(1, vocab // 32)
    return ((words >> (vocab % 32).to(torch.int32)) & 1).bool()
