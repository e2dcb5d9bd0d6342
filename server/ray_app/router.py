"""PrefixAffinityRouter: Ray Serve's request router for graphserve replicas (RequestRouter API, set in the
replica deployment's request_router_config; it runs in the ingress's handle).

A prompt goes to the replica holding its longest cached prefix (PrefixMap over the engine's block keys,
which the ingress computed), unless that replica's queue exceeds the least loaded one's by more than
`imbalance_threshold` requests; otherwise, and for prompts nobody holds, to the least loaded replica:
fewest ongoing requests (Ray's count), then the lowest KV-cache use the replicas report
(record_routing_stats, ray_app/replica.py), then the fewest prefixes held (so new prompts spread over the
replicas). Replicas that report a dead engine, and those a request excludes (ones that already failed
it; ReplicaQuery's), are passed over."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from graphserve.server.ray_app.forwarded import ForwardedRequest, ReplicaQuery
from graphserve.server.ray_app.prefix_map import DEFAULT_MAX_BLOCKS, PrefixMap

DEFAULT_IMBALANCE_THRESHOLD = 4  # ongoing requests


def forwarded_request(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None:
        return None
    return next((a for a in pending_request.args if isinstance(a, ForwardedRequest)), None)


def excluded_replicas(pending_request: PendingRequest | None) -> frozenset[str]:
    if pending_request is None:
        return frozenset()
    return frozenset().union(*(a.exclude for a in pending_request.args if isinstance(a, (ForwardedRequest, ReplicaQuery))))


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         max_blocks: int = DEFAULT_MAX_BLOCKS, **_: Any) -> None:
        self.imbalance_threshold = imbalance_threshold
        self.prefixes = PrefixMap(max_blocks)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        request = forwarded_request(pending_request)
        exclude = excluded_replicas(pending_request)
        usable = [r for r in candidate_replicas
                  if r.replica_id.unique_id not in exclude and r.routing_stats.get("engine_ok", True)]
        candidates = usable or candidate_replicas  # all failed it: let one answer (the ingress stops retrying)
        if not candidates:
            return []
        queues = await self._queue_lengths(candidates)

        def load(r: RunningReplica) -> tuple[float, float, int]:
            return (queues.get(r.replica_id, float("inf")), float(r.routing_stats.get("kv_usage", 0.0)),
                    self.prefixes.blocks_held(r.replica_id.unique_id))

        ranked = sorted(candidates, key=load)
        chosen = ranked[0]
        if request is not None and request.prefix_keys:
            match = self.prefixes.longest_match(request.prefix_keys, [r.replica_id.unique_id for r in candidates])
            if match.blocks:
                best = next(r for r in ranked if r.replica_id.unique_id in match.holders)
                if load(best)[0] - load(chosen)[0] <= self.imbalance_threshold:
                    chosen = best
        rest = [r for r in ranked if r is not chosen]
        return [[chosen], rest] if rest else [[chosen]]

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Each replica's ongoing requests: Ray's cache (kept by every send and completion), else a probe."""
        lengths: dict[ReplicaID, int] = {}
        missing = []
        for r in replicas:
            length = self.replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if length is None:
                missing.append(r)
            else:
                lengths[r.replica_id] = length
        if missing:
            for r, length in await self._probe_queue_lens(missing, 0):
                if length is not None:
                    lengths[r.replica_id] = length
        return lengths

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = forwarded_request(pending_request)
        if request is not None and request.prefix_keys:
            self.prefixes.record(request.prefix_keys, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in self.prefixes.replicas() - {r.replica_id.unique_id for r in replicas}:
            self.prefixes.forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.forget(replica_id.unique_id)
