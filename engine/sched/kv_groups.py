"""KV cache groups: the layers grouped by their window, one BlockManager (pool of block ids, cache tensors)
per group, and the coordinator the scheduler and the engine talk to (docs/architecture.md, KV cache groups).

A model whose layers all share one window has one group, exactly the single pool of before. Gemma 3 and
gpt-oss have two: the full-attention layers (group 0, which keeps every block) and the windowed ones, whose
pool gives back what the window no longer reads. Every decision (admission, growth, preemption, a prefix
hit) is taken on all groups at once: a sequence gets blocks in every group or in none."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphserve.engine.config import EngineConfig
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.request import Sequence
from graphserve.engine.sched.kv_cache import BlockManager, window_blocks, windowed_hold


@dataclass(frozen=True)
class KVLayout:
    """Which layers share a pool: each group's window (group 0 the full-attention one when there is one,
    then the windows from the smallest) and each layer's group."""

    windows: tuple[int | None, ...]
    layer_groups: tuple[int, ...]

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...]) -> "KVLayout":
        windows = tuple(sorted(set(layer_windows), key=lambda w: (w is not None, w or 0)))
        return cls(windows, tuple(windows.index(w) for w in layer_windows))

    @classmethod
    def single(cls, num_layers: int) -> "KVLayout":
        """Every layer in one group that keeps every block (a draft model reads the target's group 0 table)."""
        return cls((None,), (0,) * num_layers)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def num_layers(self, group: int) -> int:
        return self.layer_groups.count(group)

    def pool_blocks(self, full_blocks: int, config: EngineConfig) -> list[int]:
        """Each group's pool (the dummy block included) when group 0's has `full_blocks`: a windowed group
        after the first holds what max_num_seqs decoding sequences hold at once (their windows and a round
        ahead) and one prefill's most (windowed_hold), never more than group 0's."""
        ahead = 2 * config.decode_chunk + config.num_speculative_tokens + 1
        sizes = [full_blocks]
        for window in self.windows[1:]:
            per_seq = window_blocks(window, ahead, config.block_size)
            sizes.append(min(full_blocks, config.max_num_seqs * per_seq + windowed_hold(window, config) + 1))
        return sizes

    def bytes_for(self, full_blocks: int, config: EngineConfig, bytes_per_layer_block: int) -> int:
        return sum(n * self.num_layers(g) * bytes_per_layer_block
                   for g, n in enumerate(self.pool_blocks(full_blocks, config)))


class KVGroups:
    """One BlockManager per KV cache group; the scheduler's, the engine's and the runner's one view of
    the KV blocks. Counts (free, used, total) are summed over the groups; `usage` is the fullest group's."""

    def __init__(self, pools: list[BlockManager], layout: KVLayout):
        assert [p.group for p in pools] == list(range(len(pools))) == list(range(layout.num_groups))
        self.pools = pools
        self.layout = layout
        self.block_size = pools[0].block_size
        self._windowed = [p for p in pools if p.window is not None]

    @classmethod
    def build(cls, layout: KVLayout, full_blocks: int, config: EngineConfig, cache_salt: str = "") -> "KVGroups":
        sizes = layout.pool_blocks(full_blocks, config)
        return cls([BlockManager(n, config.block_size, config.prefix_caching, cache_salt=cache_salt, window=w, group=g)
                    for g, (n, w) in enumerate(zip(sizes, layout.windows))], layout)

    @classmethod
    def single(cls, pool: BlockManager, num_layers: int) -> "KVGroups":
        return cls([pool], KVLayout((pool.window,), (0,) * num_layers))

    @property
    def num_groups(self) -> int:
        return len(self.pools)

    @property
    def window(self) -> int | None:
        """The window of a model with one group (every layer's), else None."""
        return self.pools[0].window if len(self.pools) == 1 else None

    @property
    def prefix_caching(self) -> bool:
        return self.pools[0].prefix_caching

    @prefix_caching.setter
    def prefix_caching(self, on: bool) -> None:
        for pool in self.pools:
            pool.prefix_caching = on

    @property
    def root(self) -> bytes:
        return self.pools[0].root

    @property
    def rounds_launched(self) -> int:
        return self.pools[0].rounds_launched

    @rounds_launched.setter
    def rounds_launched(self, count: int) -> None:
        for pool in self.pools:
            pool.rounds_launched = count

    def _sum(self, name: str) -> int:
        return sum(getattr(pool, name) for pool in self.pools)

    @property
    def num_blocks(self) -> int:
        return self._sum("num_blocks")

    @property
    def num_usable_blocks(self) -> int:
        return self._sum("num_usable_blocks")

    @property
    def num_free_blocks(self) -> int:
        return self._sum("num_free_blocks")

    @property
    def num_cached_free_blocks(self) -> int:
        return self._sum("num_cached_free_blocks")

    @property
    def num_context_blocks(self) -> int:
        """The full-attention group's usable blocks: how many blocks of context the pools hold (a windowed
        group's blocks only ever hold a window's worth of a sequence)."""
        return self.pools[0].num_usable_blocks

    @property
    def usage(self) -> float:
        """The fullest group's share of blocks owned by requests, 0 to 1 (cached-free blocks count as
        free): admission stops when any group runs out, so that group is the one a load gauge reports."""
        return max(((p.num_usable_blocks - p.num_free_blocks) / p.num_usable_blocks if p.num_usable_blocks else 0.0)
                   for p in self.pools)

    @property
    def num_used_blocks(self) -> int:
        return self._sum("num_used_blocks")

    @property
    def reserved(self) -> int:
        return self._sum("reserved")

    # ---- growth, admission, release: every group or none ----

    def drop_out_of_window(self, seq: Sequence) -> None:
        """The windowed groups give back seq's blocks its next queries no longer read."""
        for pool in self._windowed:
            pool.drop_out_of_window(seq)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Every group can give seq its first `num_tokens` slots (its reservations count)."""
        return all(pool.can_allocate(pool.blocks_to_grow(seq, num_tokens)) for pool in self.pools)

    def can_grow_all(self, seqs: list[Sequence], num_tokens: list[int]) -> bool:
        """can_grow for all of `seqs` at once."""
        return all(pool.can_allocate(sum(pool.blocks_to_grow(s, n) for s, n in zip(seqs, num_tokens)))
                   for pool in self.pools)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """seq's first `num_tokens` slots in every group (the caller checked can_grow)."""
        seq.ensure_kv_groups(len(self.pools))
        for pool in self.pools:
            pool.allocate(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        """Every group's blocks of seq back (registered first; group 0 first: it holds the keys being computed)."""
        seq.ensure_kv_groups(len(self.pools))  # (a request that ends while it waits has no table yet)
        for pool in self.pools:
            pool.free(seq)

    def register(self, seq: Sequence) -> None:
        seq.ensure_kv_groups(len(self.pools))
        for pool in self.pools:
            pool.register(seq)

    def forget_cached_blocks(self) -> None:
        for pool in self.pools:
            pool.forget_cached_blocks()

    def last_freed(self, seq: Sequence, start: int, end: int) -> int:
        return max(pool.last_freed(seq, start, end) for pool in self.pools)

    # ---- prefix caching: every group keys a block alike (group 0 holds the keys and the blocks being computed) ----

    def prefix_keys(self, seq: Sequence) -> list[bytes]:
        return self.pools[0].prefix_keys(seq)

    def adopt_prompt_keys(self, seq: Sequence, keys: list[bytes] | None) -> None:
        self.pools[0].adopt_prompt_keys(seq, keys)

    def being_computed(self, key: bytes) -> bool:
        return self.pools[0].being_computed(key)

    def mark_computing(self, seq: Sequence, keys: list[bytes]) -> None:
        self.pools[0].mark_computing(seq, keys)

    def cached_prefix(self, seq: Sequence, keys: list[bytes] | None = None) -> list[list[int]]:
        """Each group's table for the longest hit every group accepts (a full group any prefix of its run,
        a windowed group only some): the groups lower it in turn until none does."""
        keys = self.prefix_keys(seq) if keys is None else keys
        length = len(keys)
        while True:
            accepted = length
            for pool in self.pools:
                accepted = pool.longest_hit(seq, keys, accepted)
            if accepted == length:
                break
            length = accepted
        return [pool.hit_blocks(seq, keys, length) for pool in self.pools]

    def prefill_blocks(self, seq: Sequence, hit: list[list[int]], max_chunk: int) -> list[int]:
        """Per group, the blocks an admission of seq takes besides the cached ones (BlockManager.prefill_blocks)."""
        return [pool.prefill_blocks(seq, cached, max_chunk) for pool, cached in zip(self.pools, hit)]

    def can_admit(self, need: list[int], hit: list[list[int]]) -> bool:
        return all(pool.can_allocate(n + pool.num_reusable(cached)) for pool, n, cached in zip(self.pools, need, hit))

    def admit(self, seq: Sequence, hit: list[list[int]], need: list[int], num_tokens: int) -> None:
        seq.ensure_kv_groups(len(self.pools))
        for pool, cached, n in zip(self.pools, hit, need):
            pool.admit(seq, cached, n, num_tokens)

    # ---- speculative decoding ----

    def reserve_draft_slots(self, seq: Sequence, num_drafts: int) -> bool:
        """BlockManager.reserve_draft_slots in every group, or in none (False)."""
        if not self.can_grow(seq, seq.num_tokens + num_drafts):
            return False
        self.allocate(seq, seq.num_tokens + num_drafts)
        return True

    def roll_back_drafts(self, seq: Sequence) -> None:
        seq.num_computed_tokens = seq.num_tokens - 1
        self.trim(seq, seq.num_computed_tokens)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        for pool in self.pools:
            pool.trim(seq, num_tokens)


def allocate_group_kv_cache(args: ModelArgs, layout: KVLayout, pool_blocks: list[int], block_size: int,
                            dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer, each [its group's pool's blocks, block_size, num_kv_heads, head_dim]."""
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(layout.layer_groups)
    for g, num_blocks in enumerate(pool_blocks):
        layers = [i for i, lg in enumerate(layout.layer_groups) if lg == g]
        shape = (2, len(layers), num_blocks, block_size, args.num_kv_heads, args.head_dim)
        pool = torch.zeros(shape, dtype=dtype, device=device)
        for j, i in enumerate(layers):
            caches[i] = (pool[0, j], pool[1, j])
    return caches
