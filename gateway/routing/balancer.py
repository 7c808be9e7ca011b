"""Balancing policies: pure decisions over a snapshot of a preset's replicas. Nothing here logs.

Each policy returns every candidate in preference order, so a retry takes the next one without
asking again, and a reason (a bounded metric label). Replicas that are down or ejected come last:
when nothing else is left they are still tried (fail-open, like Envoy's panic mode) rather than
answering 503 at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from gateway.routing.table import Policy


# NamedTuples, not dataclasses: these are built on every request, and a tuple is the cheapest value.
class ReplicaView(NamedTuple):
    name: str
    available: bool  # healthy and not ejected
    in_flight: int
    capacity: int  # max_in_flight


class Pick(NamedTuple):
    order: tuple[str, ...]
    reason: str  # round_robin | least_busy | affinity | affinity_overload | panic


@dataclass(frozen=True)
class Balancing:
    """One policy: how it orders a snapshot, and whether it needs the request's prefix key (the
    key hashes the conversation's start, so it is computed only for policies that use it)."""

    order: Callable[[list[ReplicaView], int, str | None], tuple[list[ReplicaView], str]]
    needs_key: bool = False


def _by_rotation(pool: list[ReplicaView], ticket: int, key: str | None) -> tuple[list[ReplicaView], str]:
    return _rotate(pool, ticket), "round_robin"


def _by_load(pool: list[ReplicaView], ticket: int, key: str | None) -> tuple[list[ReplicaView], str]:
    return _least_busy(pool, ticket), "least_busy"


def _by_prefix(pool: list[ReplicaView], ticket: int, key: str | None) -> tuple[list[ReplicaView], str]:
    if key is None:
        return _by_rotation(pool, ticket, key)
    return _affinity(pool, key, ticket)


POLICIES: dict[str, Balancing] = {
    "round_robin": Balancing(_by_rotation),
    "least_busy": Balancing(_by_load),
    "prefix_affinity": Balancing(_by_prefix, needs_key=True),
}


def choose(policy: Policy, replicas: Sequence[ReplicaView], *, ticket: int, key: str | None = None) -> Pick:
    live = [r for r in replicas if r.available]
    panic = not live
    pool = list(replicas) if panic else live
    rest = [] if panic else [r for r in replicas if not r.available]
    ordered, reason = POLICIES[policy].order(pool, ticket, key)
    return Pick(tuple(r.name for r in ordered + rest), "panic" if panic else reason)


def retry_order(pick: Pick, tried: Collection[str], suspects: Collection[str]) -> Pick:
    """For a retry: replicas that others just failed to reach go last, then those this request tried.

    A connection refused on another request is strong evidence the process is gone; a reset or
    a 503 on this one is weaker (an overloaded replica). Within each group the policy's order stays.
    """
    order = sorted(pick.order, key=lambda name: (name in suspects, name in tried))
    return Pick(tuple(order), pick.reason)


def _rotate(pool: list[ReplicaView], ticket: int) -> list[ReplicaView]:
    if not pool:
        return []
    start = ticket % len(pool)
    return pool[start:] + pool[:start]


def _load(replica: ReplicaView) -> float:
    return replica.in_flight / replica.capacity


def _least_busy(pool: list[ReplicaView], ticket: int) -> list[ReplicaView]:
    # Rotation first, then a stable sort: ties go round-robin instead of always to the first replica.
    return sorted(_rotate(pool, ticket), key=_load)


def _affinity(pool: list[ReplicaView], key: str, ticket: int) -> tuple[list[ReplicaView], str]:
    """Rendezvous hashing: removing a replica moves only the keys it held; every gateway agrees."""
    ranked = sorted(pool, key=lambda r: _score(key, r.name), reverse=True)
    best = ranked[0]
    lightest = min(r.in_flight for r in pool)
    # Bounded load: a hot conversation must not pile onto one replica while another idles.
    if best.in_flight > max(2 * lightest, lightest + 2):
        return _least_busy(pool, ticket), "affinity_overload"
    return ranked, "affinity"


def _score(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
