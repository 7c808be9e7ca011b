"""Replica state and admission: who is up, how busy each one is, and who waits for a free place.

A lease is taken when a request is sent to a replica and given back when it ends or the client
leaves; balancing reads these counts, so they must never lag (late load tracking is how
cache-aware routers end up sending everything to one replica).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gateway.errors import QueueFull, QueueTimeout
from gateway.fleet.health import HealthState
from gateway.fleet.slots import SlotMap
from gateway.routing.balancer import POLICIES, Pick, ReplicaView, choose
from gateway.routing.table import Health, Preset, ReplicaSpec, Table
from gateway.types import Clock


@dataclass
class Replica:
    spec: ReplicaSpec
    health: HealthState
    max_in_flight: int  # as configured
    preset: str
    in_flight: int = 0
    batch_in_flight: int = 0  # of in_flight, the batch-priority requests
    context: int | None = None  # vLLM max_model_len / llama-server meta.n_ctx, from /v1/models
    slots: int | None = None  # llama-server's total_slots, from /props
    served_ids: tuple[str, ...] = ()
    probe_latency: float | None = None
    backend_metrics: dict[str, float] = field(default_factory=dict)  # from the replica's own /metrics
    prompt_tokens: int = 0  # reported by the replica, for its prefix-cache hit ratio
    cached_tokens: int = 0
    last_used: float = float("-inf")  # when a request last took or gave back a place (idle unload, LRU)
    cache: SlotMap = field(default_factory=SlotMap)  # which session holds which slot (fleet/slots.py)
    waiting: int = 0  # session requests queued for this replica alone (pipeline/attempts.py)

    # The spec's name, URL and engine, read a dozen times per request: copied once, as plain
    # attributes. A reload hands a replica a new spec only with the same three (Fleet._replica).
    name: str = field(init=False)
    url: str = field(init=False)
    engine: str = field(init=False)

    def __post_init__(self) -> None:
        self.name, self.url, self.engine = self.spec.name, self.spec.url, self.spec.engine

    def api_key(self) -> str | None:
        # Read at use, so a rotated key in the environment needs no restart; never logged.
        return os.environ.get(self.spec.api_key_env) if self.spec.api_key_env else None

    @property
    def limit(self) -> int:
        """Requests it may hold at once. llama-server serves HTTP on slots + 2 threads by default,
        and connections beyond those wait in its queue until it closes them unanswered; so unless
        the table says otherwise, the gateway queues the excess itself."""
        if self.spec.max_in_flight is None and self.engine == "llamacpp" and self.slots:
            return min(self.max_in_flight, self.slots + 2)
        return self.max_in_flight

    def view(self, now: float) -> ReplicaView:
        return ReplicaView(self.name, self.health.available(now), self.in_flight, self.limit)

    def session_view(self, now: float, session: str | None, group: str | None) -> ReplicaView:
        """The view `policy: session` places by: load, and the replica's cache as it concerns the session."""
        metrics = self.backend_metrics
        cache = self.cache.view(
            session,
            group,
            kv_usage=metrics.get("kv_cache_usage_ratio"),
            prefill_rate=metrics.get("prompt_tokens_per_second") or None,
        )
        load = self.in_flight + self.waiting  # those queued for it wait before this one
        return ReplicaView(self.name, self.health.available(now), load, self.limit, cache)


class PoolRetired(Exception):
    """The pool a request waited in was replaced by a reload; the preset's name is the argument."""


class Pool:
    """One preset's replicas, its round-robin ticket and its admission queue.

    Two priority classes wait apart: a freed place goes to the oldest interactive waiter that can
    use it, and to a batch waiter only when none can and the replica holds fewer batch requests
    than its batch share. A freed place is handed to the waiter (leased for it) rather than left
    for whoever comes next, so a newcomer never overtakes a request that was woken for it.
    """

    def __init__(self, preset: Preset, replicas: Sequence[Replica], clock: Clock = time.monotonic) -> None:
        self.preset = preset
        self.replicas = list(replicas)
        self.clock = clock
        self._tickets = itertools.count()
        # Each waiter with the replicas it may use, oldest first; a release hands the freed place
        # to the oldest one that can use it (a request pinned elsewhere must not swallow it).
        self._waiters: deque[_Waiter] = deque()  # interactive
        self._batch: deque[_Waiter] = deque()
        self.retired = False  # a reload replaced this pool: its waiters must pick again in the new one

    @property
    def queued(self) -> int:
        return len(self._waiters) + len(self._batch)

    @property
    def queued_batch(self) -> int:
        return len(self._batch)

    def panic(self) -> bool:
        now = self.clock()
        return bool(self.replicas) and not any(r.health.available(now) for r in self.replicas)

    def ready(self) -> bool:
        now = self.clock()
        return any(r.health.ready(now) for r in self.replicas)

    def ticket(self) -> int:
        return next(self._tickets)

    def pick(
        self,
        ticket: int,
        key: str | None = None,
        exclude: Iterable[str] = (),
        *,
        session: str | None = None,
        group: str | None = None,
        tokens: int = 0,
    ) -> Pick:
        now = self.clock()
        skip = set(exclude)
        if POLICIES[self.preset.policy].sessions and session is not None:
            views = [r.session_view(now, session, group) for r in self.replicas if r.name not in skip]
            return choose(self.preset.policy, views, ticket=ticket, key=session, tokens=tokens)
        views = [r.view(now) for r in self.replicas if r.name not in skip]
        return choose(self.preset.policy, views, ticket=ticket, key=key)

    def get(self, name: str) -> Replica | None:
        return next((r for r in self.replicas if r.name == name), None)

    def batch_cap(self, replica: Replica) -> int:
        """Places of `replica` that batch requests may hold at once: rounded down, at least one."""
        return max(1, math.floor(replica.limit * self.preset.limits.batch_max_share))

    async def admit(self, pick: Pick, deadline: float, batch: bool = False) -> Replica:
        """The first replica of `pick` with a free place, else wait in the bounded queue.

        Raises PoolRetired once a reload has replaced this pool, so that a queued request is not
        sent to a replica the new table removed or moved."""
        if self.retired:
            raise PoolRetired(self.preset.name)
        replica = self._first_free(pick, batch)
        if replica is not None:
            return self._lease(replica, batch)
        limits = self.preset.limits
        # Batch waiters never fill the queue for interactive ones: each class has `queue` places.
        line = self._batch if batch else self._waiters
        if (self.queued if batch else len(line)) >= limits.queue:
            raise QueueFull(
                f"Preset '{self.preset.name}' is at capacity and its queue is full; retry shortly",
                headers={"retry-after": "1"},
            )
        wait_until = min(deadline, self.clock() + limits.queue_timeout)
        waiter: asyncio.Future[Replica | None] = asyncio.get_running_loop().create_future()
        entry = _Waiter(waiter, frozenset(pick.order), batch)
        line.append(entry)
        try:
            async with asyncio.timeout(max(0.0, wait_until - self.clock())):
                handed = await waiter
        except TimeoutError:
            raise QueueTimeout(
                f"Preset '{self.preset.name}' had no free replica within the queue timeout",
                headers={"retry-after": "5"},
            ) from None
        except asyncio.CancelledError:
            # Handed a place, then cancelled before it ran (its client left): the place goes on.
            if waiter.done() and not waiter.cancelled() and (freed := waiter.result()) is not None:
                self.release(freed, batch)
            raise
        finally:
            if entry in line:
                line.remove(entry)
        if handed is None:
            raise PoolRetired(self.preset.name)
        return handed

    def release(self, replica: Replica, batch: bool = False) -> None:
        replica.in_flight -= 1
        if batch:
            replica.batch_in_flight -= 1
        replica.last_used = self.clock()
        self._hand_over(replica)

    def _hand_over(self, replica: Replica) -> None:
        if replica.in_flight >= replica.limit:
            return
        for line in (self._waiters, self._batch):
            if line is self._batch and replica.batch_in_flight >= self.batch_cap(replica):
                return
            for entry in line:
                if not entry.future.done() and replica.name in entry.usable:
                    line.remove(entry)
                    entry.future.set_result(self._lease(replica, entry.batch))
                    return

    def retire(self) -> None:
        """After a reload: every waiter leaves at once (PoolRetired) to pick again in the new table,
        instead of waiting for a release in a dead pool or taking a place in it."""
        self.retired = True
        for line in (self._waiters, self._batch):
            while line:
                entry = line.popleft()
                if not entry.future.done():
                    entry.future.set_result(None)

    def _first_free(self, pick: Pick, batch: bool) -> Replica | None:
        for name in pick.order:
            replica = self.get(name)
            if replica is None or replica.in_flight >= replica.limit:
                continue
            if batch and replica.batch_in_flight >= self.batch_cap(replica):
                continue
            return replica
        return None

    def _lease(self, replica: Replica, batch: bool) -> Replica:
        replica.in_flight += 1
        if batch:
            replica.batch_in_flight += 1
        replica.last_used = self.clock()
        return replica


@dataclass(eq=False)  # compared by identity: two waiters are never the same one
class _Waiter:
    future: asyncio.Future[Replica | None]
    usable: frozenset[str]
    batch: bool


class Fleet:
    """Every preset's pool. Rebuilt on reload; replicas that stay keep their state and counts."""

    def __init__(self, table: Table, clock: Clock = time.monotonic, previous: Fleet | None = None) -> None:
        self.table = table
        self.clock = clock
        old = {r.name: r for r in previous.replicas()} if previous else {}
        self.pools: dict[str, Pool] = {}
        shared: dict[str, Replica] = {}
        for preset in table.presets.values():
            members = []
            for spec in preset.replicas:
                if spec.name not in shared:
                    shared[spec.name] = self._replica(spec, preset, table.health, old)
                members.append(shared[spec.name])
            before = previous.pools.get(preset.name) if previous else None
            if (
                before is not None
                and preset.discover is not None
                and before.preset.discover == preset.discover
            ):
                # Replicas found in DNS stay until discovery says otherwise.
                listed = {spec.name for spec in preset.replicas}
                members += [r for r in before.replicas if r.name not in listed]
            self.pools[preset.name] = Pool(preset, members, clock)
        for pool in previous.pools.values() if previous else ():
            pool.retire()

    @staticmethod
    def _replica(spec: ReplicaSpec, preset: Preset, health: Health, old: dict[str, Replica]) -> Replica:
        limit = spec.max_in_flight or preset.limits.max_in_flight
        kept = old.get(spec.name)
        if kept is not None and kept.spec.url == spec.url and kept.spec.engine == spec.engine:
            kept.spec, kept.max_in_flight, kept.preset = spec, limit, preset.name
            kept.health.config = health
            return kept
        return Replica(spec=spec, health=HealthState(health), max_in_flight=limit, preset=preset.name)

    def replicas(self) -> list[Replica]:
        """Every replica once, also one that serves several presets."""
        return list({id(r): r for pool in self.pools.values() for r in pool.replicas}.values())

    def not_ready(self) -> list[str]:
        return [name for name, pool in self.pools.items() if not pool.ready()]
