"""Replicas the gateway launches: started on demand, stopped when idle or to make room, restarted
after a crash, `failed` after a crash loop.

One `Unit` per launched replica, in one of the states below; every change happens on the event
loop between two awaits, so a state read and the decision on it never interleave with another
request's. Which occupants make room is `capacity.plan_start` (pure); processes are
`process.EngineProcess`; readiness is the replica's own `/health` answering 200.

    stopped --start--> starting --/health 200--> ready --idle/evicted--> stopping --> stopped
                          ^                        |   (vLLM `sleep: true`: --> sleeping, its
                          +------- /wake_up -------+    device freed; a wake is a fast start)
       ^                  |                        |
       |                  +--exit, timeout--+      +--exit (crash)--+
       |                                    v                       v
       +----------- backoff ---------- (failure counted) ---> failed (after max_failures)

A request for a preset whose launched replicas are all stopped calls `ensure`, which starts one
(evicting idle replicas of other presets where the devices are short) and waits, within the
preset's `timeouts.load`, until it is ready. Replicas without `launch` are never touched.

A ready replica may be `draining` (a flag, shown by `ps`): another preset's request has waited its
`max_wait`, so it takes no new requests and is evicted once the running ones end. Until then, one
that keeps getting requests stays for its preset's `min_resident` (`_occupant` says who may go).

A llama-server replica keeps its agent sessions across a stop: before its process goes, each slot
that holds a session is saved (`POST /slots/{id}?action=save`, into the engine's
`--slot-save-path`), and after its next start, before it takes a request, each is restored into the
same slot (`action=restore`) and checked (docs/engines.md §13: about 3 ms for 9k tokens). A restore
that fails or brings back less than RESTORED_SHARE of the saved tokens is logged and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import orjson

from gateway.errors import LoadTimeout, NoUpstream, ReplicaFailed
from gateway.fleet.capacity import Occupant, plan_start
from gateway.fleet.health import Status
from gateway.fleet.process import EngineProcess, tail
from gateway.fleet.replicas import Fleet, Pool, Replica
from gateway.fleet.slots import slot_file
from gateway.routing.table import Launch, ReplicaSpec
from gateway.types import Clock
from gateway.upstream import Timeouts, UpstreamClient, UpstreamError

log = logging.getLogger("gateway")

UnitState = Literal["stopped", "starting", "ready", "stopping", "sleeping", "failed"]
RUNNING: frozenset[UnitState] = frozenset({"starting", "ready", "stopping"})  # holds its devices
TICK = 0.5  # the idle and health watch
HEALTH_POLL = 0.25  # while a start waits for /health
# A streaming client waiting for a load hears from the gateway soon, then every few seconds, so
# that neither it nor a proxy in between gives up on a silent connection.
LOADING_FIRST, LOADING_EVERY = 1.0, 5.0
# A replica whose last request ended this long ago is idle: another preset may evict it at once.
IDLE_AFTER = 2.0
RESTORED_SHARE = 0.9  # a restore that brings back less of a saved slot has failed
SLOT_ACTION_TIMEOUT = 120.0  # one slot's save or restore: a file of up to GiBs on a GPU model


@dataclass
class Unit:
    spec: ReplicaSpec
    log_path: Path
    state: UnitState = "stopped"
    since: float = 0.0
    reason: str = ""
    process: EngineProcess | None = None
    failures: deque[float] = field(default_factory=deque)
    not_before: float = 0.0  # no start before this (the backoff after a failure)
    last_load: float | None = None  # seconds the last successful start took
    draining: bool = False  # ready, but takes no new requests: it makes room once they end
    claimed: bool = False  # stopped, but replicas were evicted for it: its room is held for it
    ready_since: float | None = None
    loads: int = 0
    evictions: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def launch(self) -> Launch:
        assert self.spec.launch is not None
        return self.spec.launch


class Supervisor:
    def __init__(
        self,
        fleet: Callable[[], Fleet],
        client: UpstreamClient,
        log_dir: Path,
        probe: Callable[[Replica], Awaitable[object]] | None = None,
        clock: Clock = time.monotonic,
        on_load: Callable[[str, str, float], None] = lambda name, outcome, seconds: None,
        on_evict: Callable[[str], None] = lambda name: None,
    ) -> None:
        self._fleet = fleet
        self.client = client
        self.log_dir = log_dir
        self.probe = probe
        self.clock = clock
        self.units: dict[str, Unit] = {}
        self.waiting: dict[str, int] = {}  # requests waiting for a start, per preset
        self.closing = False
        self._changed: asyncio.Event = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None
        # For the metrics: each start's (replica, outcome, seconds), each eviction's replica.
        self.on_load, self.on_evict = on_load, on_evict

    # --- the table's replicas -------------------------------------------------------------------

    def sync(self) -> None:
        """Units for the table's launched replicas; one the table dropped or changed is stopped."""
        wanted = {r.name: r.spec for r in self._fleet().replicas() if r.spec.launch is not None}
        for name, unit in list(self.units.items()):
            spec = wanted.get(name)
            if spec is None or spec.launch != unit.spec.launch or spec.url != unit.spec.url:
                del self.units[name]
                self._spawn_task(self._stop(unit, "removed from the table"))
            else:
                unit.spec = spec  # uses, idle_unload, keep may change in place
        for name, spec in wanted.items():
            if name not in self.units:
                self.units[name] = Unit(spec, self.log_dir / f"{name}.log", since=self.clock())

    def replica(self, name: str) -> Replica | None:
        return next((r for r in self._fleet().replicas() if r.name == name), None)

    def active(self, replica: Replica) -> bool:
        """Whether the prober should probe it: a stopped engine answers nothing worth logging."""
        unit = self.units.get(replica.name)
        return unit is None or unit.state == "ready"

    def unavailable(self, pool: Pool) -> list[str]:
        """Launched replicas of the pool that must not be picked (panic routing included)."""
        if not self.units:  # a fleet the gateway launches nothing of: asked on every request
            return []
        return [
            r.name for r in pool.replicas if (u := self.units.get(r.name)) is not None and not _serving(u)
        ]

    def on_demand(self, pool: Pool) -> bool:
        """Every replica is launched and none is failed: the pool serves after a start."""
        units = [self.units.get(r.name) for r in pool.replicas]
        return bool(units) and all(u is not None and u.state != "failed" for u in units)

    def outlook(self, pool: Pool) -> tuple[bool, bool, float | None]:
        """For fallbacks: whether every launched replica of the pool failed, whether a request must
        wait for a start, and the seconds that start should take (the last load's, less what a
        start in progress has done; None before any load was measured)."""
        units = [self.units.get(r.name) for r in pool.replicas]
        launched = [u for u in units if u is not None]
        if not launched or len(launched) < len(units) or any(_serving(u) for u in launched):
            return False, False, None
        live = [u for u in launched if u.state != "failed"]
        if not live:
            return True, False, None
        now = self.clock()
        expected = [
            max(0.0, u.last_load - (now - u.since)) if u.state == "starting" else u.last_load
            for u in live
            if u.last_load is not None
        ]
        return False, True, (min(expected) if expected else None)

    # --- running --------------------------------------------------------------------------------

    async def start(self, preload: Iterable[str]) -> None:
        self.sync()
        for unit in self.units.values():
            if await self._port_taken(unit):
                self._fail(unit, "its port is in use by a process the gateway did not start")
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        fleet = self._fleet()
        for preset in preload:
            pool = fleet.pools.get(preset)
            if pool is not None:
                self._spawn_task(self._preload(pool))

    async def _preload(self, pool: Pool) -> None:
        with contextlib.suppress(NoUpstream):
            await self.ensure(pool, self.clock() + pool.preset.timeouts.load)

    async def close(self) -> None:
        """Stop everything the gateway started (after the server drained its requests)."""
        self.closing = True
        self._notify()
        if self._watcher is not None:
            self._watcher.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(self._stop(u, "the gateway stopped") for u in self.units.values()))

    # --- the request path -----------------------------------------------------------------------

    async def ensure(
        self, pool: Pool, deadline: float, notify: Callable[[float], Awaitable[None]] | None = None
    ) -> float:
        """Until a replica of `pool` can take the request: 0 at once when one is ready (or the pool
        has replicas the gateway does not launch); else the seconds spent starting one. `notify`
        hears the seconds waited so far, the first time after LOADING_FIRST, then every
        LOADING_EVERY (a streaming client's `: loading` comments)."""
        if not self.units:
            return 0.0
        units = [u for r in pool.replicas if (u := self.units.get(r.name)) is not None]
        if not units or len(units) < len(pool.replicas) or any(_serving(u) for u in units):
            return 0.0
        name = pool.preset.name
        self.waiting[name] = self.waiting.get(name, 0) + 1
        try:
            return await self._ensure(pool, units, deadline, notify)
        finally:
            self.waiting[name] -= 1
            if not self.waiting[name]:
                for unit in units:  # nobody waits for it any more: the room it held is free again
                    if unit.claimed and unit.state in ("stopped", "sleeping"):
                        unit.claimed = False
                        self._notify()

    async def _ensure(
        self,
        pool: Pool,
        units: list[Unit],
        deadline: float,
        notify: Callable[[float], Awaitable[None]] | None,
    ) -> float:
        began = self.clock()
        holders: tuple[str, ...] = ()
        notice = LOADING_FIRST
        while True:
            waited = self.clock() - began
            if notify is not None and waited >= notice:
                await notify(waited)
                notice += LOADING_EVERY
            if self.closing:
                raise NoUpstream("The gateway is shutting down", headers={"retry-after": "5"})
            if any(_serving(u) for u in units):
                return self.clock() - began
            live = [u for u in units if u.state != "failed"]
            if not live:
                raise self._failed(pool, units)
            if not any(u.state == "starting" for u in live):
                # A sleeping replica wakes in seconds: it goes before a cold start.
                unit = min(live, key=lambda u: (u.state != "sleeping", u.not_before))
                if unit.state in ("stopped", "sleeping") and self.clock() >= unit.not_before:
                    holders = self._try_start(unit, urgent=waited >= pool.preset.max_wait)
            if not await self._wait_change(deadline):
                raise self._no_room(pool, holders, deadline - began)

    def _try_start(self, unit: Unit, urgent: bool = False) -> tuple[str, ...]:
        """Start `unit` now if the devices allow, evicting idle occupants; else who holds them.
        `urgent`: its request waited the preset's `max_wait`, so busy holders drain for it."""
        running = [u for u in self.units.values() if (u.state in RUNNING or u.claimed) and u is not unit]
        plan = plan_start(
            self._fleet().table.devices, [self._occupant(u, urgent) for u in running], unit.spec.uses
        )
        if not plan.fits:
            if urgent:
                for name in plan.holders:
                    holder = self.units[name]
                    if holder.state == "ready" and not holder.spec.keep and not holder.draining:
                        holder.draining = True
                        log.warning("replica %s draining to make room for %s", name, unit.name)
                        self._notify()
            return plan.holders
        if plan.evict:
            unit.claimed = True  # the room these evictions free is this unit's, not the next starter's
            for name in plan.evict:
                victim = self.units[name]
                victim.evictions += 1
                self.on_evict(name)
                log.warning("replica %s evicted (idle) to make room for %s", name, unit.name)
                # Stopping now, not when the task runs: another waiter this tick must not pick it too.
                self._become(victim, "stopping", f"evicted for {unit.name}")
                self._spawn_task(self._put_away(victim, f"evicted for {unit.name}"))
            return ()  # the start follows once their processes have exited
        if unit.state == "sleeping":
            self._become(unit, "starting", "waking up")
            self._spawn_task(self._wake(unit))
            return ()
        self._become(unit, "starting", "start requested")
        self._spawn_task(self._run(unit))
        return ()

    def _occupant(self, unit: Unit, urgent: bool = False) -> Occupant:
        """Evictable: ready, not `keep`, nothing in flight, and one of: idle for IDLE_AFTER, resident
        for its preset's `min_resident`, draining, or the waiting request is `urgent`. So requests
        that keep coming for a resident preset are served before a swap, within the other's wait."""
        replica = self.replica(unit.name)
        now = self.clock()
        last_used = replica.last_used if replica is not None else float("-inf")
        evictable = False
        if unit.state == "ready" and not unit.spec.keep and replica is not None and replica.in_flight == 0:
            pool = self._fleet().pools.get(replica.preset)
            min_resident = pool.preset.min_resident if pool is not None else 0.0
            evictable = (
                urgent
                or unit.draining
                or now - last_used >= IDLE_AFTER
                or (unit.ready_since is not None and now - unit.ready_since >= min_resident)
            )
        return Occupant(unit.name, unit.spec.uses, evictable=evictable, last_used=last_used)

    # --- one start, one process -----------------------------------------------------------------

    async def _run(self, unit: Unit) -> None:
        """Start the process, wait for /health, then watch it until it exits."""
        began = self.clock()
        process = EngineProcess(unit.name, unit.launch, unit.log_path)
        unit.process = process
        try:
            await process.start()
        except OSError as exc:
            self._failure(unit, f"could not start: {exc.strerror or exc}")
            self.on_load(unit.name, "error", self.clock() - began)
            return
        log.warning("replica %s starting (pid %s)", unit.name, process.pid)
        exited = asyncio.get_running_loop().create_task(process.wait())
        try:
            ready = await self._until_healthy(unit, exited, began + unit.launch.load_timeout)
            if unit.state != "starting":  # stopped by us meanwhile (shutdown, reload): not a failure
                return
            if not ready:
                reason = (
                    f"exited with status {exited.result()} while loading"
                    if exited.done()
                    else f"not healthy within its load_timeout of {unit.launch.load_timeout:g} s"
                )
                await process.stop()
                self._failure(unit, reason)
                self.on_load(unit.name, "error", self.clock() - began)
                return
            unit.last_load, unit.loads = self.clock() - began, unit.loads + 1
            self.on_load(unit.name, "ok", unit.last_load)
            replica = self.replica(unit.name)
            if replica is not None:
                replica.health.on_started()
                replica.last_used = self.clock()  # a fresh start is not the least recently used
                if self.probe is not None:
                    with contextlib.suppress(Exception):
                        await self.probe(replica)  # its context length and slots, at once
                if replica.engine == "llamacpp" and replica.cache.saved:
                    await self._restore_slots(replica)  # before any request can reach a slot
            self._become(unit, "ready", f"ready in {unit.last_load:.1f} s")
            log.warning("replica %s ready in %.1f s", unit.name, unit.last_load)
            code = await exited
            if self.state_of(unit) in ("ready", "sleeping", "starting"):  # not a stop of ours: a crash
                self._failure(unit, f"exited with status {code}", restart=True)
        finally:
            exited.cancel()

    async def _until_healthy(self, unit: Unit, exited: asyncio.Task[int], deadline: float) -> bool:
        url = unit.spec.url + "/health"
        while self.clock() < deadline and not exited.done() and not self.closing:
            with contextlib.suppress(UpstreamError, OSError):
                status, _ = await self.client.get(url, [], 2.0)
                if status == 200:
                    return True
            await asyncio.wait({exited}, timeout=HEALTH_POLL)
        return False

    async def _put_away(self, unit: Unit, reason: str) -> None:
        """Make room: a vLLM with `sleep: true` sleeps (still alive, its device freed), else stop."""
        if unit.launch.sleep and unit.process is not None and unit.process.running:
            self._become(unit, "stopping", f"going to sleep ({reason})")
            replica = self.replica(unit.name)
            if replica is not None:
                replica.health.on_stopped("sleeping")
            if await self._post(unit, "/sleep?level=1"):
                self._become(unit, "sleeping", reason)
                return
            log.warning("replica %s did not sleep: stopping it instead", unit.name)
        await self._stop(unit, reason)

    async def _wake(self, unit: Unit) -> None:
        began = self.clock()
        if await self._post(unit, "/wake_up"):
            unit.last_load, unit.loads = self.clock() - began, unit.loads + 1
            self.on_load(unit.name, "ok", unit.last_load)
            replica = self.replica(unit.name)
            if replica is not None:
                replica.health.on_started()
                replica.last_used = self.clock()
            self._become(unit, "ready", f"woke in {unit.last_load:.1f} s")
            log.warning("replica %s woke up in %.1f s", unit.name, unit.last_load)
            return
        log.warning("replica %s did not wake up: restarting it", unit.name)
        await self._stop(unit, "wake_up failed")  # the next request starts it afresh

    async def _post(self, unit: Unit, path: str) -> bool:
        try:
            response = await self.client.send(unit.spec.url + path, [], b"", Timeouts(5.0, 120.0, 120.0))
            try:
                await response.read(4096)
                return response.status == 200
            finally:
                await response.close()
        except (UpstreamError, OSError):
            return False

    async def _stop(self, unit: Unit, reason: str) -> None:
        process = unit.process
        if unit.state in ("stopped", "failed") and (process is None or not process.running):
            return
        serving = unit.state in ("ready", "stopping") and process is not None and process.running
        self._become(unit, "stopping", reason)
        replica = self.replica(unit.name)
        if replica is not None:
            if serving and replica.engine == "llamacpp" and not self.closing:
                await self._save_slots(replica)
            replica.health.on_stopped(reason)
        if process is not None:
            await process.stop()
        if replica is not None:
            replica.cache.clear()  # the engine's slots and memory tier went with its process
        self._become(unit, "stopped", reason)

    # --- sessions kept across a stop ---------------------------------------------------------------

    async def _save_slots(self, replica: Replica) -> None:
        """Each slot that holds a session, to a file of the engine's --slot-save-path, before a stop."""
        cache = replica.cache
        cache.saved.clear()
        for slot, session, group, tokens in list(cache.to_save()):
            began = self.clock()
            answer = await self._slot_action(replica, slot, "save", slot_file(replica.name, slot))
            saved = answer.get("n_saved") if answer is not None else None
            if not isinstance(saved, int) or saved <= 0:
                cache.stats.save_failures += 1
                log.warning(
                    "replica %s: slot %d (session %s, %d tokens) could not be saved before the stop; "
                    "is the engine started with --slot-save-path?",
                    replica.name,
                    slot,
                    session[:8],
                    tokens,
                )
                continue
            cache.stats.saves += 1
            cache.stats.saved_tokens += saved
            cache.stats.save_seconds += self.clock() - began
            cache.saved[slot] = (session, group, saved)
        if cache.saved:
            log.warning("replica %s: %d slots saved before the stop", replica.name, len(cache.saved))

    async def _restore_slots(self, replica: Replica) -> None:
        """The slots saved before the last stop, each into the slot it came from, and checked."""
        cache = replica.cache
        saved, cache.saved = dict(cache.saved), {}
        restored = 0
        for slot, (session, group, tokens) in sorted(saved.items()):
            if cache.slots is None or slot >= cache.slots:
                cache.stats.restore_failures += 1
                log.warning("replica %s: slot %d is gone after the restart; not restored", replica.name, slot)
                continue
            began = self.clock()
            answer = await self._slot_action(replica, slot, "restore", slot_file(replica.name, slot))
            got = answer.get("n_restored") if answer is not None else None
            if not isinstance(got, int) or got < RESTORED_SHARE * tokens:
                cache.stats.restore_failures += 1
                log.warning(
                    "replica %s: slot %d (session %s) restored %s of %d saved tokens",
                    replica.name,
                    slot,
                    session[:8],
                    got if isinstance(got, int) else "none",
                    tokens,
                )
                continue
            cache.stats.restores += 1
            cache.stats.restored_tokens += got
            cache.stats.restore_seconds += self.clock() - began
            cache.restored(slot, session, group, got + 1, self.clock())
            restored += 1
        log.warning("replica %s: %d of %d saved slots restored", replica.name, restored, len(saved))

    async def _slot_action(
        self, replica: Replica, slot: int, action: str, filename: str
    ) -> dict[str, object] | None:
        """One `POST /slots/{slot}?action=...`; its JSON answer, or None when it failed."""
        headers = [("content-type", "application/json")]
        key = replica.api_key()
        if key:
            headers.append(("authorization", f"Bearer {key}"))
        body = orjson.dumps({"filename": filename})
        url = f"{replica.url}/slots/{slot}?action={action}"
        try:
            response = await self.client.send(
                url, headers, body, Timeouts(5.0, SLOT_ACTION_TIMEOUT, SLOT_ACTION_TIMEOUT)
            )
            try:
                data = await response.read(4096)
                ok = response.status == 200
            finally:
                await response.close()
        except (UpstreamError, OSError):
            return None
        if not ok:
            return None
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, dict) else None

    def _failure(self, unit: Unit, reason: str, restart: bool = False) -> None:
        """A crash or a failed start: counted; a restart after the backoff (at once for a replica
        that was serving, else on the next request), or `failed`."""
        now = self.clock()
        restarts = self._fleet().table.restarts
        unit.failures.append(now)
        while unit.failures and unit.failures[0] < now - restarts.window:
            unit.failures.popleft()
        replica = self.replica(unit.name)
        if replica is not None:
            replica.health.on_stopped(reason)
        if len(unit.failures) >= restarts.max_failures:
            self._fail(unit, f"{reason}; {len(unit.failures)} failures within {restarts.window:g} s")
            return
        delay = min(restarts.first_delay * 2 ** (len(unit.failures) - 1), restarts.max_delay)
        unit.not_before = now + delay
        self._become(unit, "stopped", reason)
        log.warning("replica %s: %s; next start in %.0f s at the earliest", unit.name, reason, delay)
        if restart and not self.closing:
            self._spawn_task(self._restart(unit, delay))

    async def _restart(self, unit: Unit, delay: float) -> None:
        await asyncio.sleep(delay)
        if unit.state == "stopped" and not self.closing and self.units.get(unit.name) is unit:
            occupants = [self._occupant(u) for u in self.units.values() if u.state in RUNNING or u.claimed]
            plan = plan_start(self._fleet().table.devices, occupants, unit.spec.uses)
            if plan.fits and not plan.evict:  # a restart takes free room only; a request may evict
                self._try_start(unit)

    async def _unhealthy(self, unit: Unit, why: str) -> None:
        """Ready, process alive, but its health probes fail: a crash in all but name."""
        self._become(unit, "stopping", why)
        if unit.process is not None:
            await unit.process.stop()
        self._failure(unit, why, restart=True)

    def _fail(self, unit: Unit, reason: str) -> None:
        self._become(unit, "failed", reason)
        log.error("replica %s failed: %s", unit.name, reason)

    # --- the watch: idle unload, a ready replica whose health failed ------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            now = self.clock()
            for unit in list(self.units.values()):
                replica = self.replica(unit.name)
                if unit.state != "ready" or replica is None:
                    continue
                if unit.draining and not any(n for p, n in self.waiting.items() if p != replica.preset):
                    unit.draining = False  # whoever it drained for gave up or was served
                    self._notify()
                if replica.health.status is Status.DOWN:
                    self._spawn_task(self._unhealthy(unit, f"health failed ({replica.health.last_reason})"))
                    continue
                if replica.in_flight:
                    continue
                if unit.spec.idle_unload and now - replica.last_used >= unit.spec.idle_unload:
                    log.warning(
                        "replica %s idle for %.0f s: unloading it", unit.name, now - replica.last_used
                    )
                    self._spawn_task(self._put_away(unit, "idle"))

    # --- waiting --------------------------------------------------------------------------------

    @staticmethod
    def state_of(unit: Unit) -> UnitState:
        """Read afresh after an await (another task may have moved it)."""
        return unit.state

    def _become(self, unit: Unit, state: UnitState, reason: str) -> None:
        unit.state, unit.reason, unit.since = state, reason, self.clock()
        if state not in ("stopped", "sleeping"):
            unit.claimed = False
        if state != "ready":
            unit.draining = False
        unit.ready_since = unit.since if state == "ready" else None
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, deadline: float) -> bool:
        """Until any unit changes state (True), or a short tick for backoffs, or the deadline."""
        left = deadline - self.clock()
        if left <= 0:
            return False
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(left, TICK)):
                await changed.wait()
        return True

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _port_taken(self, unit: Unit) -> bool:
        parts = urlsplit(unit.spec.url)
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port or 80), timeout=1.0
            )
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True

    # --- the errors a waiting request gets ------------------------------------------------------

    def _failed(self, pool: Pool, units: list[Unit]) -> NoUpstream:
        unit = units[0]
        last = tail(unit.log_path, lines=5)
        message = f"Preset '{pool.preset.name}' is failed: replica {unit.name} {unit.reason}"
        if last:
            message += f". Last log lines: {last}"
        return ReplicaFailed(message, headers={"retry-after": "30"})

    def _no_room(self, pool: Pool, holders: tuple[str, ...], waited: float) -> NoUpstream:
        if holders:
            held = ", ".join(f"{h} ({self._holding(h)})" for h in holders)
            message = f"Preset '{pool.preset.name}' could not start within {waited:.0f} s: "
            message += f"its device is held by {held}"
        else:
            message = f"Preset '{pool.preset.name}' did not become ready within {waited:.0f} s"
        return LoadTimeout(message, headers={"retry-after": "10"})

    def _holding(self, name: str) -> str:
        unit, replica = self.units.get(name), self.replica(name)
        if unit is not None and unit.spec.keep:
            return "keep"
        if replica is not None and replica.in_flight:
            return f"serving {replica.in_flight}"
        return unit.state if unit is not None else "running"

    # --- the operator's actions (admin endpoints) ------------------------------------------------

    async def start_one(self, name: str, deadline: float) -> Unit:
        """Start this replica (evicting idle ones if needed) and wait until it is ready."""
        unit = self.units[name]
        if unit.state == "failed":  # an operator's start is a fresh chance
            unit.failures.clear()
            unit.not_before = 0.0
            self._become(unit, "stopped", "start requested by an operator")
        holders: tuple[str, ...] = ()
        began = self.clock()
        while unit.state != "ready":
            if unit.state in ("stopped", "sleeping") and self.clock() >= unit.not_before:
                holders = self._try_start(unit)
            if unit.state == "failed" or not await self._wait_change(deadline):
                break
        if unit.state != "ready":
            fleet = self._fleet()
            pool = next(p for p in fleet.pools.values() if any(r.name == name for r in p.replicas))
            raise (
                self._failed(pool, [unit])
                if unit.state == "failed"
                else self._no_room(pool, holders, self.clock() - began)
            )
        return unit

    async def stop_one(self, name: str) -> Unit:
        """Stop it once its running answers end (new requests go elsewhere or start it again)."""
        unit = self.units[name]
        replica = self.replica(name)
        if unit.state == "ready":
            self._become(unit, "stopping", "stop requested by an operator")  # no new picks
            while replica is not None and replica.in_flight:
                await self._wait_change(self.clock() + TICK)
        await self._stop(unit, "stopped by an operator")
        return unit

    # --- the operator's view --------------------------------------------------------------------

    def view(self) -> list[dict[str, object]]:
        now = self.clock()
        out = []
        for unit in self.units.values():
            replica = self.replica(unit.name)
            out.append(
                {
                    "name": unit.name,
                    "state": unit.state,
                    "draining": unit.draining,
                    "reason": unit.reason,
                    "since_s": round(now - unit.since, 1),
                    "uses": dict(unit.spec.uses),
                    "in_flight": replica.in_flight if replica is not None else 0,
                    "idle_s": round(now - replica.last_used, 1)
                    if replica is not None and replica.last_used > float("-inf")
                    else None,
                    "last_load_s": None if unit.last_load is None else round(unit.last_load, 2),
                    "loads": unit.loads,
                    "evictions": unit.evictions,
                    "pid": unit.process.pid if unit.process is not None and unit.process.running else None,
                    "log_tail": tail(unit.log_path, lines=10) if unit.state == "failed" else "",
                    # Its slots and the session each holds (`fleet-gateway ps`), and those saved
                    # across its last stop.
                    "slots": replica.cache.rows(now) if replica is not None else [],
                    "saved_slots": len(replica.cache.saved) if replica is not None else 0,
                }
            )
        return out


def _serving(unit: Unit) -> bool:
    """Ready and taking new requests."""
    return unit.state == "ready" and not unit.draining
