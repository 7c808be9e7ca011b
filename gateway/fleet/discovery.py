"""Replicas found in DNS: a preset's `discover: {dns, port, engine, every}` resolves a name (a
Kubernetes headless Service) to its addresses on a timer and adds or removes replicas without a
restart. Removing a replica only stops new requests to it; requests in flight finish.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable

from gateway.fleet.health import HealthState
from gateway.fleet.replicas import Fleet, Pool, Replica
from gateway.routing.table import Discover, Health, ReplicaSpec

log = logging.getLogger("gateway.fleet.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]
Probe = Callable[[Replica], Awaitable[object]]


async def resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def discovered_spec(preset: str, found: Discover, address: str) -> ReplicaSpec:
    host = f"[{address}]" if ":" in address else address
    return ReplicaSpec(
        name=f"{preset}-{address.replace(':', '.')}-{found.port}",
        url=f"{found.scheme}://{host}:{found.port}",
        engine=found.engine,
        api_key_env=found.api_key_env,
    )


def update_pool(pool: Pool, specs: Iterable[ReplicaSpec], health: Health) -> tuple[list[Replica], list[str]]:
    """Make the pool's discovered members exactly `specs` (listed replicas stay): (added, removed names)."""
    wanted = {spec.name: spec for spec in specs}
    listed = {spec.name for spec in pool.preset.replicas}
    kept = [r for r in pool.replicas if r.name in listed or r.name in wanted]
    removed = [r.name for r in pool.replicas if r.name not in listed and r.name not in wanted]
    present = {r.name for r in kept}
    added = [
        Replica(
            spec=spec,
            health=HealthState(health),
            max_in_flight=pool.preset.limits.max_in_flight,
            preset=pool.preset.name,
        )
        for name, spec in wanted.items()
        if name not in present
    ]
    pool.replicas = kept + added
    return added, removed


class Discovery:
    """Keeps the DNS-discovered replicas of every preset with `discover:` in step with their name's
    addresses: `refresh` resolves each preset whose interval has passed, adds and probes new
    replicas and drops gone ones; `run` repeats it every second. The app forces one refresh before
    serving."""

    def __init__(
        self,
        fleet: Callable[[], Fleet],
        probe: Probe,
        resolver: Resolver = resolve,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fleet = fleet
        self._probe = probe
        self._resolver = resolver
        self._clock = clock
        self._due: dict[str, float] = {}

    def wanted(self) -> bool:
        return any(pool.preset.discover is not None for pool in self._fleet().pools.values())

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(1.0)

    async def refresh(self, force: bool = False) -> None:
        """Resolve every preset whose interval has passed (all of them when forced)."""
        fleet = self._fleet()
        now = self._clock()
        for name, pool in fleet.pools.items():
            found = pool.preset.discover
            if found is None or (not force and now < self._due.get(name, 0.0)):
                continue
            self._due[name] = now + found.every
            try:
                addresses = await self._resolver(found.dns, found.port)
            except OSError as exc:
                # Keep the replicas we have: a DNS hiccup must not empty a preset.
                log.warning("discovery for preset %s: %s did not resolve (%s)", name, found.dns, exc)
                continue
            specs = [discovered_spec(name, found, address) for address in addresses]
            added, removed = update_pool(pool, specs, fleet.table.health)
            for replica in added:
                await self._probe(replica)  # probed before it is counted on, not after the next cycle
            if added or removed:
                log.info(
                    "discovery for preset %s: +%s -%s",
                    name,
                    ",".join(r.name for r in added) or "none",
                    ",".join(removed) or "none",
                )
