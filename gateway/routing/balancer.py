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
class CacheView(NamedTuple):
    """One replica's cache as it concerns one session (fleet/slots.py builds it)."""

    slots: int | None  # llama-server's slots; None for vLLM (one shared block cache) or not read yet
    sessions: int  # sessions it holds, in its slots or its memory tier (llama-server), or served (vLLM)
    free: int  # slots holding no session
    home: bool  # it holds this session (in a slot or in its memory tier)
    cached: int  # this session's tokens it holds
    displaced: int  # tokens of the session a newcomer pushes out of its slot (0: a free slot)
    group_here: bool  # the session's parent agent session has a session here
    kv_usage: float | None = None  # vLLM's KV-cache use, 0 to 1
    prefill_rate: float | None = None  # prompt tokens per second, as the replica reports it
    turn_seconds: float | None = None  # how long its session requests take, recently (a moving average)


class ReplicaView(NamedTuple):
    name: str
    available: bool  # healthy and not ejected
    in_flight: int
    capacity: int  # max_in_flight
    cache: CacheView | None = None  # for `policy: session` only


class Pick(NamedTuple):
    order: tuple[str, ...]
    # round_robin | least_busy | affinity | affinity_overload | panic
    # | session_home | session_new | session_moved | session_overload
    reason: str


@dataclass(frozen=True)
class Balancing:
    """One policy: how it orders a snapshot, and whether it needs the request's prefix key (the
    key hashes the conversation's start, so it is computed only for policies that use it)."""

    order: Callable[[list[ReplicaView], int, str | None, int], tuple[list[ReplicaView], str]]
    needs_key: bool = False
    sessions: bool = False  # it reads each replica's cache picture (CacheView) for the session


def _by_rotation(
    pool: list[ReplicaView], ticket: int, key: str | None, tokens: int
) -> tuple[list[ReplicaView], str]:
    return _rotate(pool, ticket), "round_robin"


def _by_load(
    pool: list[ReplicaView], ticket: int, key: str | None, tokens: int
) -> tuple[list[ReplicaView], str]:
    return _least_busy(pool, ticket), "least_busy"


def _by_prefix(
    pool: list[ReplicaView], ticket: int, key: str | None, tokens: int
) -> tuple[list[ReplicaView], str]:
    if key is None:
        return _by_rotation(pool, ticket, key, tokens)
    return _affinity(pool, key, ticket)


def _by_session(
    pool: list[ReplicaView], ticket: int, key: str | None, tokens: int
) -> tuple[list[ReplicaView], str]:
    if key is None or any(r.cache is None for r in pool):
        return _by_prefix(pool, ticket, key, tokens)
    return place(pool, tokens, ticket)


POLICIES: dict[str, Balancing] = {
    "round_robin": Balancing(_by_rotation),
    "least_busy": Balancing(_by_load),
    "prefix_affinity": Balancing(_by_prefix, needs_key=True),
    # The affinity key is its fallback when the request names no session.
    "session": Balancing(_by_session, needs_key=True, sessions=True),
}


def choose(
    policy: Policy,
    replicas: Sequence[ReplicaView],
    *,
    ticket: int,
    key: str | None = None,
    tokens: int = 0,
) -> Pick:
    live = [r for r in replicas if r.available]
    panic = not live
    pool = list(replicas) if panic else live
    rest = [] if panic else [r for r in replicas if not r.available]
    ordered, reason = POLICIES[policy].order(pool, ticket, key, tokens)
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


# --- placement by cost (`policy: session`) ------------------------------------------------------

DEFAULT_PREFILL_RATE = 2000.0  # prompt tokens per second, for a replica that reports none
TURN_SECONDS = 5.0  # a request's service time, for the wait behind a full replica that measured none
MOVE_MARGIN = 1.0  # seconds: a known session leaves its replica only when that saves more
KV_FULL = 0.9  # vLLM's KV use past which a newcomer evicts other sessions' cached blocks


def cost(
    replica: ReplicaView, tokens: int, service: float = TURN_SECONDS, rate: float = DEFAULT_PREFILL_RATE
) -> float:
    """Seconds this request is expected to cost on `replica`: its wait for a place, its prefill
    of what the replica does not hold, and the prefill it imposes on the session it displaces
    (docs/prefix-cache.md §5). `service`: how long a request holds a place; `rate`: prompt tokens
    prefilled per second."""
    cache = replica.cache
    assert cache is not None
    parallel = _parallel(replica)
    # Behind a full replica a request waits for one of its `parallel` places to come free.
    wait = max(0, replica.in_flight - parallel + 1) / parallel * service
    prefill = max(0, tokens - cache.cached) / rate
    displaced = 0.0
    if not cache.home:
        displaced = cache.displaced / rate
        if cache.kv_usage is not None and cache.kv_usage >= KV_FULL:
            displaced += tokens / rate
    return wait + prefill + displaced


def place(pool: list[ReplicaView], tokens: int, ticket: int) -> tuple[list[ReplicaView], str]:
    """Where a session's request goes: every replica in order of cost.

    A known session goes back to the replica that holds it unless its wait there exceeds what a
    re-prefill elsewhere costs (by MOVE_MARGIN). A new session goes where it costs least, and while
    any replica has a free slot only to one that has: a replica never holds more sessions than
    slots while another has room; past the slots, to the replica with the fewest sessions per slot.
    Bounded load as for affinity: a replica far busier than the lightest one gives way."""
    rotated = _rotate(pool, ticket)  # ties go round-robin
    # A session's prompt only grows: it is at least what a replica holds of it (the request's own
    # estimate counts characters, which undercounts some tokenizers several times over).
    tokens = max([tokens, *(r.cache.cached for r in pool if r.cache is not None)])
    # One service time for the whole pool: a replica's own average moves with its luck (how many
    # of its recent requests missed), and a wait compared on that noise would move sessions for nothing.
    # The same for the prefill rate: the replicas of a preset run one model, and their reported
    # averages differ with their recent mix, which would steer new sessions by noise.
    measured = [r.cache.turn_seconds for r in pool if r.cache is not None and r.cache.turn_seconds]
    service = sum(measured) / len(measured) if measured else TURN_SECONDS
    rates = [r.cache.prefill_rate for r in pool if r.cache is not None and r.cache.prefill_rate]
    rate = sum(rates) / len(rates) if rates else DEFAULT_PREFILL_RATE
    costs = {r.name: cost(r, tokens, service, rate) for r in rotated}
    ranked = sorted(rotated, key=lambda r: costs[r.name])
    # Home is where most of the session is cached (it may be known on two after a move).
    known = [r for r in rotated if r.cache is not None and r.cache.home]
    home = max(known, key=lambda r: r.cache.cached if r.cache is not None else 0) if known else None
    if home is not None:
        best_other = next((r for r in ranked if r is not home), None)
        if best_other is None or costs[best_other.name] + MOVE_MARGIN >= costs[home.name]:
            chosen, reason = home, "session_home"
        else:
            chosen, reason = best_other, "session_moved"
    else:
        roomy = [r for r in ranked if r.cache is not None and r.cache.slots and r.cache.free > 0]
        if roomy:
            chosen = min(roomy, key=lambda r: (costs[r.name], _crowding(r), not _beside_parent(r)))
        else:
            # Every slot taken: the sessions beyond them spread evenly over the replicas' memory, a
            # session's whole life long, whatever the queues look like at its first turn.
            chosen = min(ranked, key=lambda r: (_crowding(r), costs[r.name], not _beside_parent(r)))
        reason = "session_new"
    # Bounded load, as a safety net under the cost model: only where a whole round of requests
    # queues ahead. Requests up to a replica's slots run side by side, each in its session's slot;
    # sending one elsewhere to even out in-flight counts would trade its cached prompt for nothing.
    lightest = min(r.in_flight for r in pool)
    if chosen.in_flight >= 2 * _parallel(chosen) and chosen.in_flight > max(2 * lightest, lightest + 2):
        return _least_busy(pool, ticket), "session_overload"
    return [chosen, *(r for r in ranked if r is not chosen)], reason


def _parallel(replica: ReplicaView) -> int:
    """Requests the replica runs at once: its slots (llama-server), else its admission limit."""
    return (replica.cache.slots if replica.cache is not None else None) or replica.capacity


def _crowding(replica: ReplicaView) -> float:
    cache = replica.cache
    assert cache is not None
    return cache.sessions / max(1, cache.slots or replica.capacity)


def _beside_parent(replica: ReplicaView) -> bool:
    return replica.cache is not None and replica.cache.group_here
