"""The router's memory of which replica holds which prompt prefix: the engine's prefix-cache block keys
(engine/sched/prefix_hash.py, sha256 chains over token ids; never the text) -> the replicas a prompt
with that block was sent to. Bounded: least recently used keys go first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_MAX_BLOCKS = 65536  # ~1M tokens of distinct prefixes at 16 tokens a block; ~200 bytes a block


@dataclass(frozen=True)
class PrefixMatch:
    blocks: int  # how many of the prompt's leading blocks the holders have
    holders: frozenset[str]  # the replicas that hold that many (empty when blocks is 0)


class PrefixMap:
    """Block key -> a bit mask of replicas. A key is chained over every block before it, so a replica that
    holds a prompt's block i holds its blocks 0..i as well, unless the map evicted them first: the
    walk stops at the first key a replica lacks."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._owners: OrderedDict[bytes, int] = OrderedDict()
        self._bits: dict[str, int] = {}  # replica id -> its bit
        self._free_bits: list[int] = []
        self._held: dict[str, int] = {}  # replica id -> how many keys have its bit

    def __len__(self) -> int:
        return len(self._owners)

    def longest_match(self, keys: Sequence[bytes], replicas: Iterable[str]) -> PrefixMatch:
        """The longest leading run of `keys` some of `replicas` hold, and which of them hold it all."""
        candidates = {self._bits[r]: r for r in replicas if r in self._bits}
        mask = sum(1 << bit for bit in candidates)
        blocks = 0
        for key in keys:
            held = self._owners.get(key, 0) & mask
            if not held:
                break
            mask = held
            blocks += 1
            self._owners.move_to_end(key)
        if blocks == 0:
            return PrefixMatch(0, frozenset())
        return PrefixMatch(blocks, frozenset(r for bit, r in candidates.items() if mask >> bit & 1))

    def record(self, keys: Sequence[bytes], replica: str) -> None:
        """`replica` was sent a prompt with these block keys: after it, its prefix cache holds them."""
        bit = 1 << self._bit_of(replica)
        for key in keys:
            mask = self._owners.get(key, 0)
            if not mask & bit:
                self._held[replica] += 1
            self._owners[key] = mask | bit
            self._owners.move_to_end(key)
        while len(self._owners) > self.max_blocks:
            _, mask = self._owners.popitem(last=False)
            for owner, owner_bit in self._bits.items():
                if mask >> owner_bit & 1:
                    self._held[owner] -= 1

    def blocks_held(self, replica: str) -> int:
        """How many blocks the map credits `replica` with: new prefixes go to the replica with the fewest
        when the loads are equal, which spreads them over the replicas."""
        return self._held.get(replica, 0)

    def forget(self, replica: str) -> None:
        """The replica is gone (died, scaled down): clear its bit everywhere, so that a replica that
        takes the bit later is not credited with the old one's cache."""
        bit = self._bits.pop(replica, None)
        self._held.pop(replica, None)
        if bit is None:
            return
        clear = ~(1 << bit)
        for key in [k for k, mask in self._owners.items() if mask >> bit & 1]:
            mask = self._owners[key] & clear
            if mask:
                self._owners[key] = mask
            else:
                del self._owners[key]
        self._free_bits.append(bit)

    def replicas(self) -> set[str]:
        return set(self._bits)

    def _bit_of(self, replica: str) -> int:
        bit = self._bits.get(replica)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else len(self._bits)
            self._bits[replica] = bit
            self._held[replica] = 0
        return bit
