"""The prefix cache's block keys, decided here for the core (engine/sched/kv_cache.py) and for the front
ends, which hash a prompt's full blocks beside its tokenization, so the engine core's thread does
not (Qwen2.5-0.5B on an H200, 32 prompts of 2,032 tokens: the hashing was about a quarter of the
time from submission to the first tokens of a wave whose prefix was cached).

A block's key is sha256(parent block's key + the block's token ids as int64 bytes), the first
block's parent being sha256 of the cache salt (whatever else the KV depends on: the model), and for
a request with a LoRA adapter a key of that root and the adapter's id (adapter_root)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain_root(cache_salt: str) -> bytes:
    return hashlib.sha256(cache_salt.encode()).digest()


def adapter_root(root: bytes, lora_id: int | None) -> bytes:
    """The chain root of a request's blocks: the cache's, or for a request with a LoRA adapter (its
    KV differs) a root of that adapter's load (LoraRequest.lora_id), so KV is never shared across them."""
    return root if lora_id is None else block_key(root, b"lora:%d" % lora_id)


def block_bytes(token_ids: Sequence[int], first: int, end: int, block_size: int) -> list[bytes]:
    """The token ids of full blocks first..end-1 as int64 bytes, one bytes object per block."""
    data, step = array("q", token_ids[first * block_size:end * block_size]).tobytes(), block_size * 8
    return [data[i:i + step] for i in range(0, len(data), step)]


def block_key(parent: bytes, block: bytes) -> bytes:
    return hashlib.sha256(parent + block).digest()


def chain_keys(parent: bytes, blocks: list[bytes]) -> list[bytes]:
    """The keys of `blocks`, the first of which follows the block whose key is `parent`."""
    keys = []
    for block in blocks:
        parent = block_key(parent, block)
        keys.append(parent)
    return keys


def num_prompt_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a prompt's lookup covers: those before its last token (always recomputed,
    so that the first output has logits)."""
    return (num_tokens - 1) // block_size


def prompt_keys(token_ids: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """The keys a prompt is looked up with (a front end sends them with the request)."""
    return chain_keys(root, block_bytes(token_ids, 0, num_prompt_blocks(len(token_ids), block_size), block_size))
