"""Which replicas must make room for a start: pure, so the rule is read and tested on its own.

A replica may start when the free capacity on every device it uses covers what it needs. If not,
idle occupants (nothing in flight, not `keep`) are evicted least recently used first, only as many
as the shortfall needs; an occupant that is serving or kept is never chosen. When even every idle
occupant would not be enough, nothing is evicted and the caller waits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Occupant:
    """A replica holding device memory: the GiB it uses per device, whether it may be evicted (idle
    and not `keep`), and when it last served, for least-recently-used order."""

    name: str
    uses: Mapping[str, float]
    evictable: bool  # idle and not `keep`
    last_used: float


@dataclass(frozen=True)
class Room:
    """Whether a start fits, and what must stop to make room for it."""

    fits: bool  # True: start now, after stopping `evict` (possibly none)
    evict: tuple[str, ...] = ()
    holders: tuple[str, ...] = ()  # when it does not fit: who holds the devices it needs


def free(devices: Mapping[str, float], occupants: Sequence[Occupant]) -> dict[str, float]:
    left = dict(devices)
    for occupant in occupants:
        for device, gib in occupant.uses.items():
            left[device] = left.get(device, 0.0) - gib
    return left


def plan_start(
    devices: Mapping[str, float], occupants: Sequence[Occupant], needs: Mapping[str, float]
) -> Room:
    """Decides whether a replica needing `needs` GiB per device fits the `devices`' capacity beside
    `occupants`: fits as is, fits after evicting the idle occupants named (least recently used
    first, only those that free a short device), or does not fit, naming who holds the devices."""
    left = free(devices, occupants)
    short = {d: gib - left.get(d, 0.0) for d, gib in needs.items() if gib > left.get(d, 0.0) + 1e-9}
    if not short:
        return Room(True)
    chosen: list[str] = []
    for occupant in sorted((o for o in occupants if o.evictable), key=lambda o: o.last_used):
        if not any(occupant.uses.get(d, 0.0) > 0 for d in short):
            continue  # stopping it frees nothing this start needs
        chosen.append(occupant.name)
        for device in list(short):
            short[device] -= occupant.uses.get(device, 0.0)
            if short[device] <= 1e-9:
                del short[device]
        if not short:
            return Room(True, tuple(chosen))
    holders = tuple(o.name for o in occupants if any(o.uses.get(d, 0.0) > 0 for d in needs))
    return Room(False, (), holders)
