"""What the ingress sends a replica for one HTTP request, and the head of what comes back; the query of a
replica's own state. Plain dataclasses (Ray pickles them); the body was read and bounded by the ingress."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    # the prompt's prefix-cache block keys (engine/sched/prefix_hash.py), for the request router; empty
    # for requests without a prompt or whose prompt the ingress could not read (the replica answers them)
    prefix_keys: tuple[bytes, ...] = ()
    # replicas that already failed this request before sending any of it (ray_app/ingress.py retries)
    exclude: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class ResponseHead:
    """The first item a replica yields: the status, the headers and who answered; body chunks follow."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str


@dataclass(frozen=True)
class ReplicaQuery:
    """The argument of GraphserveReplica.replica_status: the router passes over the replicas in `exclude`,
    so a caller can reach every replica in turn (tests, benchmarks, operators)."""

    exclude: frozenset[str] = field(default_factory=frozenset)
