"""The team at run time: who a key is, whether it may use a preset, its limits, and its usage.

Holds the keyring (swapped whole on SIGHUP), the counters (local or shared, state.py) and the
concurrency gates. What the gateway calls:
- at start-up, `await start()` (before serving): the shared counters probe Redis once, so that
  /ready's `redis` condition is the truth from the start;
- at admission, `await reserve(identity, preset, tokens)` with the tokens the request is expected
  to cost: 429 when the key's rate or token window is already at or over its limit; otherwise the
  request is counted, its tokens are reserved in the key's token windows at once (so concurrent
  requests see each other: one may overshoot an empty window, the next is refused), and the
  `Admission` holds the preset's round-robin `ticket` and the `reservation`;
- once the request ended, whatever the outcome, `charge(name, preset, usage, reservation)`: the
  real tokens (as the engine reported them, or what was counted of a stream cut early) replace
  the reservation, and the usage is counted; a request refused or failed before it reached a
  replica is charged `Usage()`, which releases its reservation.
A stream that crosses a limit is never cut; the next request is refused until the window slides.
`ticket(identity, preset)` is `reserve` with nothing reserved, and `charge` without a reservation
counts the tokens when the answer ends (the calls from before reservations).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
from typing import Any

from gateway.errors import Forbidden, RateLimited
from gateway.team.gates import Gate
from gateway.team.keys import ANONYMOUS, Identity, Keyring
from gateway.team.limits import USAGE_FIELDS, Usage
from gateway.team.state import Counters, create_counters
from gateway.team.windows import Admission, LocalCounters, Reservation

log = logging.getLogger("gateway.team")


class Team:
    """The keyring, the counters and the concurrency gates of one gateway process."""

    def __init__(self, keyring: Keyring, counters: Counters) -> None:
        self.keyring = keyring
        self.counters = counters
        self._gates: dict[str, Gate] = {}
        self._charging: set[asyncio.Future[None]] = set()

    @classmethod
    def solo(cls) -> Team:
        """No keys, counters in this process: an open gateway, or a test's."""
        return cls(Keyring({}), create_counters(None))

    def names(self) -> tuple[str, ...]:
        return self.keyring.names or (ANONYMOUS,)

    def check_preset(self, identity: Identity, preset: str) -> None:
        if not identity.allows(preset):
            allowed = ", ".join(sorted(identity.presets or ())) or "none"
            raise Forbidden(
                f"Key '{identity.name}' may not use preset '{preset}'; its presets: {allowed}",
                code="preset_not_allowed",
            )

    async def start(self) -> None:
        """Once, before serving: the counters' condition is known from the first /ready on."""
        await self.counters.start()

    async def reserve(self, identity: Identity, preset: str, tokens: int) -> Admission:
        """Checks the key's rate and token limits (429 with Retry-After when over one), counts the
        request and reserves `tokens` in its token windows; returns the admission: the preset's
        round-robin position (`ticket`, shared between gateways) and the `reservation` to hand to
        `charge` when the request ends."""
        admission = await self.counters.admit(identity.name, identity.limits, preset, tokens)
        denial = admission.denial
        if denial is not None:
            retry = max(1, math.ceil(denial.retry_after))
            raise RateLimited(
                denial.message(identity.name), code=denial.limit, headers={"retry-after": str(retry)}
            )
        return admission

    async def ticket(self, identity: Identity, preset: str) -> int:
        """`reserve` with nothing reserved: the tokens count when `charge` is called."""
        return (await self.reserve(identity, preset, 0)).ticket

    def running(
        self, identity: Identity, timeout: float, queue: int
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """Holds one of the key's `concurrent` places for the request's whole answer (nothing to
        hold for a key without that limit)."""
        limit = identity.limits.concurrent
        if limit is None:
            return _NOTHING_HELD
        return _Holding(self._gates.setdefault(identity.name, Gate()), identity.name, limit, timeout, queue)

    def in_flight(self) -> dict[str, int]:
        return {name: gate.in_flight for name, gate in self._gates.items() if gate.in_flight}

    def waiting(self) -> dict[str, int]:
        """Requests waiting for one of their key's `concurrent` places, by key."""
        return {name: gate.waiting for name, gate in self._gates.items() if gate.waiting}

    def charge(self, name: str, preset: str, usage: Usage, reservation: Reservation | None = None) -> None:
        """The request's real tokens in place of its reservation, and its usage; counted at once in
        this process, in the background with Redis: the answer has ended, nothing waits for this."""
        if isinstance(self.counters, LocalCounters):
            self.counters.charge_now(name, preset, usage, reservation)
            return
        task = asyncio.ensure_future(self._charge(name, preset, usage, reservation))
        self._charging.add(task)
        task.add_done_callback(self._charging.discard)

    async def _charge(self, name: str, preset: str, usage: Usage, reservation: Reservation | None) -> None:
        try:
            await self.counters.charge(name, preset, usage, reservation)
        except Exception:  # the counters keep their own failover; this is a last line
            log.exception("usage of key %s on preset %s could not be counted", name, preset)

    async def settle(self) -> None:
        """Waits for the charges in flight (shutdown, tests)."""
        if self._charging:
            await asyncio.gather(*self._charging, return_exceptions=True)

    async def usage(self, identity: Identity, days: int) -> dict[str, Any]:
        """`GET /v1/usage`: the key's own usage, or every key's for an admin key."""
        counted = await self.counters.usage(days)
        start = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=days - 1)
        since = dt.datetime.combine(start, dt.time(), dt.UTC).isoformat().replace("+00:00", "Z")
        if identity.admin:
            keys = {
                name: _presets(counted.get(name, {})) for name in sorted(set(counted) | set(self.names()))
            }
            return {"since": since, "keys": keys}
        return {"key": identity.name, "since": since, "presets": _presets(counted.get(identity.name, {}))}

    async def close(self) -> None:
        await self.settle()
        await self.counters.close()


_NOTHING_HELD: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()


class _Holding(contextlib.AbstractAsyncContextManager[None]):
    """One of a key's places, held for the block. A class, not a generator-based context manager:
    it is entered on every request of a key with a `concurrent` limit, and the generator costs
    about three times as much."""

    __slots__ = ("gate", "limit", "name", "queue", "timeout")

    def __init__(self, gate: Gate, name: str, limit: int, timeout: float, queue: int) -> None:
        self.gate, self.name, self.limit, self.timeout, self.queue = gate, name, limit, timeout, queue

    async def __aenter__(self) -> None:
        await self.gate.enter(self.name, self.limit, self.timeout, self.queue)

    async def __aexit__(self, *exc: object) -> None:
        self.gate.leave()


def _presets(per_preset: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {preset: {f: int(counts.get(f, 0)) for f in USAGE_FIELDS} for preset, counts in per_preset.items()}
