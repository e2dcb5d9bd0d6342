"""Hash-based random numbers of sampling: uniform noise from (seed, output position, vocabulary id, stream).

A hash, so a request's draws depend on nothing else in its batch and replay exactly for a
given seed. The sampler (engine/sample/sampler.py) draws on stream 0; speculative decoding's
verify step (engine/sample/rejection_sampler.py) draws its own coins and corrections on other streams."""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int = 0) -> torch.Tensor:
    """Uniform (0, 1) noise from a 32-bit integer hash: seeds [B] (32-bit values), positions [B]
    or [B, P] -> [B, V] or [B, P, V]."""
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    if positions.dim() == 1:
        x = seeds[:, None] * 0x9E3779B1 + positions[:, None] * 0x85EBCA77 + vocab[None, :] * 0xC2B2AE3D
    else:
        x = (seeds[:, None, None] * 0x9E3779B1 + positions[:, :, None] * 0x85EBCA77
             + vocab[None, None, :] * 0xC2B2AE3D)
    x = (x + stream * 0x27D4EB2F) & _MASK32
    for mult in (0x7FEB352D, 0x846CA68B):  # lowbias32 finalizer; low 32 bits survive int64 wraparound
        x = x ^ (x >> 16)
        x = (x * mult) & _MASK32
    x = x ^ (x >> 16)
    # top 23 bits plus one half: exact in float32 (24 significant bits), so u stays strictly inside
    # (0, 1). (With 24 bits, 2**24 - 0.5 rounded up to 2**24: u = 1, Gumbel noise +inf, and that
    # token was drawn whatever its probability, about once in 2**24 draws per vocabulary entry.)
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)
