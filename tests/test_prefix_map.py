"""The Ray request router's memory of prefixes (server/ray_app/prefix_map.py): block keys only, bounded, the
longest leading run wins, a replica that goes away is forgotten (its bit is not inherited)."""

from __future__ import annotations

import hashlib

import pytest

from graphserve.server.ray_app.prefix_map import PrefixMap


def chain(prefix: str, blocks: int) -> list[bytes]:
    """Block keys as the engine chains them: each over the one before (engine/sched/prefix_hash.py)."""
    keys, parent = [], hashlib.sha256(prefix.encode()).digest()
    for i in range(blocks):
        parent = hashlib.sha256(parent + i.to_bytes(8, "little")).digest()
        keys.append(parent)
    return keys


def test_the_replica_holding_the_longest_leading_run_wins():
    prefixes = PrefixMap()
    system = chain("system", 6)
    prefixes.record(system[:4], "a")
    prefixes.record(system[:6], "b")
    prefixes.record(chain("other", 6), "c")
    match = prefixes.longest_match(system, ["a", "b", "c"])
    assert (match.blocks, match.holders) == (6, {"b"})
    match = prefixes.longest_match(system, ["a", "c"])  # b is not a candidate (excluded, or gone)
    assert (match.blocks, match.holders) == (4, {"a"})
    prefixes.record(system[:4], "c")
    assert prefixes.longest_match(system[:4], ["a", "c"]).holders == {"a", "c"}
    assert prefixes.longest_match(chain("new", 3), ["a", "b", "c"]).blocks == 0


def test_the_map_is_bounded_and_keeps_what_was_used_last():
    prefixes = PrefixMap(max_blocks=10)
    hot = chain("hot", 4)
    prefixes.record(hot, "a")
    for n in range(20):
        prefixes.record(chain(f"cold {n}", 1), "b")
        prefixes.longest_match(hot, ["a"])  # a lookup that matches refreshes the keys it matched
        assert len(prefixes) <= 10
    assert prefixes.longest_match(hot, ["a"]).blocks == 4
    assert prefixes.blocks_held("a") == 4 and prefixes.blocks_held("b") == 6
    with pytest.raises(ValueError):
        PrefixMap(max_blocks=0)


def test_a_forgotten_replica_leaves_nothing_to_the_replica_after_it():
    prefixes = PrefixMap()
    keys = chain("system", 3)
    prefixes.record(keys, "gone")
    prefixes.record(keys[:1], "stays")
    prefixes.forget("gone")
    assert prefixes.replicas() == {"stays"} and prefixes.blocks_held("gone") == 0
    prefixes.record(chain("fresh", 2), "new")  # takes the freed bit
    assert prefixes.longest_match(keys, ["new", "stays"]).holders == {"stays"}
    assert prefixes.longest_match(keys, ["new"]).blocks == 0
    assert len(prefixes) == 3  # keys only the forgotten replica held are gone
