"""The team's counters: in this process, or shared by several gateways through Redis.

With Redis, one request costs two round trips: one script at admission (checks the rate and token
windows, logs the request, reserves the tokens the request is expected to cost in the token
windows and says in which buckets, hands out the preset's round-robin position) and one when the
answer ended (the real tokens in place of the reservation, and the day's usage). The time is
Redis's own, so gateways on hosts whose clocks differ still share one window. Every key has a TTL a
little past its window.

What the owner calls (`team.py`; both counters answer the same `Counters` calls):
- once at start-up, `start()`: the shared counters probe Redis, so that the condition /ready
  reports is the truth from the start ("unreachable" when it does not answer);
- at admission, `admit(key, limits, preset, reserve=tokens)`: the `Admission`'s denial, or its
  ticket and `reservation`;
- when the request ended, `charge(key, preset, usage, reservation)`: `usage` is what the engine
  reported, what was counted of a stream cut early, or `Usage()` for a request that never reached
  a replica (its reservation is then released). Without a reservation, `charge` counts the tokens
  in the current buckets (how a request admitted with `reserve=0` is charged).

If Redis fails, `SharedCounters` goes on with this process's windows (the condition turns
"unreachable"), which also hold every reservation Redis made for this process, so limits keep
holding for requests in flight. It keeps the usage counted meanwhile and the settlements of
reservations Redis holds (both bounded), and adds them to Redis when a later try (at most one a
second) succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from gateway.team.limits import Denial, KeyLimits, RateLimit, Usage
from gateway.team.windows import (
    KEEP_DAYS,
    Admission,
    LocalCounters,
    Reservation,
    UsageTable,
    add_counts,
    day_of,
    usage_counts,
)

log = logging.getLogger("gateway.team")

SOCKET_TIMEOUT = 0.5  # s: a Redis slower than this is treated as unreachable, the request goes on
RETRY_INTERVAL = 1.0  # s between tries while unreachable
MAX_PENDING = 4096  # rows kept for replay, of usage and of settlements each; more is dropped and logged
FIELD_SEP = "\x1f"
# Redis counts in 64-bit integers and Lua in doubles: a count past this (a replica's absurd usage
# report) is clamped, so that it cannot make a script fail and pass for Redis being away.
MAX_COUNT = 10**12
DENIALS: tuple[RateLimit, ...] = ("requests_per_minute", "tokens_per_minute", "tokens_per_day")
# A settlement's bucket argument: the current bucket with nothing reserved in it, or not this window.
CURRENT, SKIP = "", "-"


class Counters(Protocol):
    """What the team calls on its counters, in this process or shared through Redis: `start` once,
    `admit` at admission (a denial, or a ticket and reservation), `charge` when the answer ended,
    `usage` for the figures, `close` at shutdown; `condition` and `round_trips` for metrics."""

    @property
    def round_trips(self) -> int: ...

    def condition(self) -> str: ...

    async def start(self) -> None: ...

    async def admit(self, key: str, limits: KeyLimits, preset: str, reserve: int = 0) -> Admission: ...

    async def charge(
        self, key: str, preset: str, usage: Usage, reservation: Reservation | None = None
    ) -> None: ...

    async def usage(self, days: int = 1) -> UsageTable: ...

    async def close(self) -> None: ...


# Both scripts start with the time: Redis's own clock (ARGV[1] == ""), so that gateways on hosts
# whose clocks differ share one window, or the one a test gives.
_NOW = """
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[1])
end
"""

# KEYS: request log (zset), minute tokens (hash), day tokens (hash), the preset's ticket.
# ARGV: now ("" = Redis TIME), rpm, tpm, tpd (0 = none), a unique member for the log, the tokens
# to reserve. Returns {0, ticket, minute bucket, day bucket} or {1|2|3, allowed, used, retry_ms}.
_ADMIT = (
    _NOW
    + """
local function tokens(key, width, span, allowed)
  local oldest = math.floor(now / width) - span + 1
  local flat = redis.call('HGETALL', key)
  local used, buckets = 0, {}
  for i = 1, #flat, 2 do
    local b, v = tonumber(flat[i]), tonumber(flat[i + 1])
    if b < oldest then redis.call('HDEL', key, flat[i])
    else used = used + v; buckets[#buckets + 1] = {b, v} end
  end
  if used < allowed then return nil end
  table.sort(buckets, function(x, y) return x[1] < y[1] end)
  local left = used
  for _, bucket in ipairs(buckets) do
    left = left - bucket[2]
    if left < allowed then return {used, (bucket[1] + span) * width - now} end
  end
  return {used, width}
end
local tpd, tpm, rpm = tonumber(ARGV[4]), tonumber(ARGV[3]), tonumber(ARGV[2])
if tpd > 0 then
  local over = tokens(KEYS[3], 60, 1440, tpd)
  if over then return {3, tpd, over[1], tostring(math.ceil(over[2] * 1000))} end
end
if tpm > 0 then
  local over = tokens(KEYS[2], 1, 60, tpm)
  if over then return {2, tpm, over[1], tostring(math.ceil(over[2] * 1000))} end
end
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60)
  local n = redis.call('ZCARD', KEYS[1])
  if n >= rpm then
    local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {1, rpm, n, tostring(math.ceil((tonumber(first[2]) + 60 - now) * 1000))}
  end
  redis.call('ZADD', KEYS[1], now, ARGV[5])
  redis.call('PEXPIRE', KEYS[1], 61000)
end
local minute, day, reserve = math.floor(now), math.floor(now / 60), tonumber(ARGV[6])
if reserve > 0 then
  redis.call('HINCRBY', KEYS[2], minute, reserve)
  redis.call('EXPIRE', KEYS[2], 61)
  redis.call('HINCRBY', KEYS[3], day, reserve)
  redis.call('EXPIRE', KEYS[3], 86460)
end
local ticket = redis.call('INCR', KEYS[4])
redis.call('EXPIRE', KEYS[4], 86400)
return {0, ticket - 1, minute, day}
"""
)

# KEYS: minute tokens, day tokens, the day's usage (hash). ARGV: now ("" = TIME), the tokens
# charged, the tokens reserved, the reservation's minute bucket and day bucket ("" = the current
# one, where nothing was reserved; "-" = leave this window alone: a replay after an outage leaves
# the minute that slid past), then field, value pairs of usage.
_CHARGE = (
    _NOW
    + """
local charged, reserved = tonumber(ARGV[2]), tonumber(ARGV[3])
local function settle(key, width, span, ttl, bucket)
  if bucket == '-' then return end
  local current = math.floor(now / width)
  local b, held = current, 0
  if bucket ~= '' then b, held = tonumber(bucket), reserved end
  if b <= current - span then return end
  local delta = charged - held
  -- A reservation Redis no longer holds (it restarted empty): the charge alone is the truth.
  if held > 0 and redis.call('HEXISTS', key, b) == 0 then delta = charged end
  if delta == 0 then return end
  if redis.call('HINCRBY', key, b, delta) <= 0 then redis.call('HDEL', key, b) end
  redis.call('EXPIRE', key, ttl)
end
settle(KEYS[1], 1, 60, 61, ARGV[4])
settle(KEYS[2], 60, 1440, 86460, ARGV[5])
for i = 6, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[3], ARGV[i], tonumber(ARGV[i + 1]))
end
redis.call('EXPIRE', KEYS[3], USAGE_TTL)
return 1
""".replace("USAGE_TTL", str((KEEP_DAYS + 1) * 86400))
)


class RedisCounters:
    """Counters in Redis; every failure raises, `SharedCounters` decides what to do about it."""

    def __init__(self, url: str, prefix: str = "fleet-gateway:", clock: Callable[[], float] | None = None):
        # Imported here: a gateway without Redis never loads the client.
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.prefix = prefix
        self.round_trips = 0
        self._clock = clock
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=SOCKET_TIMEOUT,
            socket_connect_timeout=SOCKET_TIMEOUT,
            decode_responses=True,
            # No retries inside the client: a failed call falls back to local counters at once.
            retry=Retry(NoBackoff(), 0),
        )
        # What counts as Redis being away (anything else is a bug and is raised).
        self.errors: tuple[type[BaseException], ...] = (aioredis.RedisError, OSError, TimeoutError)
        self._admit = self._redis.register_script(_ADMIT)
        self._charge = self._redis.register_script(_CHARGE)
        self._member = 0
        self._origin = uuid.uuid4().hex  # this process's log entries stay distinct from others'

    def condition(self) -> str:
        return "ok"

    async def start(self) -> None:
        await self.ping()

    def _now(self) -> str:
        return "" if self._clock is None else repr(self._clock())

    def _day(self) -> dt.date:
        return day_of(self._clock() if self._clock is not None else time.time())

    async def admit(self, key: str, limits: KeyLimits, preset: str, reserve: int = 0) -> Admission:
        """Runs the admission script in one round trip: checks the key's rate and token windows,
        logs the request, reserves `reserve` tokens and takes the preset's round-robin ticket.
        Returns the ticket and the reservation with its Redis buckets, or the denial with its retry
        time."""
        self._member += 1
        p = self.prefix
        keys = [f"{p}rpm:{key}", f"{p}tpm:{key}", f"{p}tpd:{key}", f"{p}ticket:{preset}"]
        reserve = _bounded(reserve)
        args: list[str | int] = [
            self._now(),
            limits.requests_per_minute or 0,
            limits.tokens_per_minute or 0,
            limits.tokens_per_day or 0,
            f"{self._origin}-{self._member}",
            reserve,
        ]
        self.round_trips += 1
        reply: list[Any] = await self._admit(keys=keys, args=args)
        if int(reply[0]) == 0:
            return Admission(None, int(reply[1]), Reservation(reserve, redis=(int(reply[2]), int(reply[3]))))
        limit = DENIALS[int(reply[0]) - 1]
        return Admission(Denial(limit, int(reply[1]), int(reply[2]), max(int(reply[3]), 1) / 1000), 0)

    async def charge(
        self, key: str, preset: str, usage: Usage, reservation: Reservation | None = None
    ) -> None:
        counts = usage_counts(usage)
        if reservation is None or reservation.redis is None:
            await self.add(self._day(), key, preset, counts, usage.charged, minute=True)
        else:
            await self.settle(
                self._day(), key, preset, counts, reservation.redis, reservation.tokens, usage.charged
            )

    async def add(
        self, day: dt.date, key: str, preset: str, counts: dict[str, int], tokens: int, minute: bool
    ) -> None:
        """Usage, and tokens in the current buckets (the minute's only when `minute`)."""
        buckets = (CURRENT if minute else SKIP, CURRENT)
        await self._run_charge(day, key, _fields(key, preset, counts), buckets, 0, tokens)

    async def settle(
        self,
        day: dt.date,
        key: str,
        preset: str,
        counts: dict[str, int],
        buckets: tuple[int, int],
        reserved: int,
        charged: int,
    ) -> None:
        """Usage, and `charged` tokens in place of the `reserved` ones in the reservation's
        (minute, day) buckets."""
        held = (str(buckets[0]), str(buckets[1]))
        await self._run_charge(day, key, _fields(key, preset, counts), held, reserved, charged)

    async def _run_charge(
        self,
        day: dt.date,
        key: str,
        fields: list[str | int],
        buckets: tuple[str, str],
        reserved: int,
        charged: int,
    ) -> None:
        p = self.prefix
        keys = [f"{p}tpm:{key}", f"{p}tpd:{key}", f"{p}usage:{day.isoformat()}"]
        args: list[str | int] = [self._now(), _bounded(charged), _bounded(reserved), *buckets, *fields]
        self.round_trips += 1
        await self._charge(keys=keys, args=args)

    async def usage(self, days: int = 1) -> UsageTable:
        today = self._day()
        async with self._redis.pipeline(transaction=False) as pipe:
            for back in range(days):
                pipe.hgetall(f"{self.prefix}usage:{(today - dt.timedelta(days=back)).isoformat()}")
            self.round_trips += 1
            replies: list[dict[str, str]] = await pipe.execute()
        total: UsageTable = {}
        for reply in replies:
            for name, value in reply.items():
                parts = name.split(FIELD_SEP)
                if len(parts) == 3:
                    add_counts(total, parts[0], parts[1], {parts[2]: int(value)})
        return total

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


def _fields(key: str, preset: str, counts: dict[str, int]) -> list[str | int]:
    args: list[str | int] = []
    for field, value in counts.items():
        if value:
            args += [FIELD_SEP.join((key, preset, field)), _bounded(value)]
    return args


def _bounded(count: int) -> int:
    return max(0, min(count, MAX_COUNT))


class SharedCounters:
    """Redis while it answers, this process's windows while it does not; usage counted during an
    outage, and the settlements of reservations Redis holds, are added to Redis when it returns."""

    def __init__(
        self,
        remote: RedisCounters,
        local: LocalCounters | None = None,
        on_condition: Callable[[str], object] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.remote = remote
        self.local = local or LocalCounters()
        self._on_condition = on_condition
        self._monotonic = monotonic
        self._condition = "ok"
        self._next_try = 0.0
        self._pending: dict[tuple[dt.date, str, str], dict[str, int]] = {}
        self._pending_tokens: dict[tuple[dt.date, str, str], int] = {}
        # (key, minute bucket, day bucket) in Redis's clock -> (tokens reserved, tokens charged)
        self._settlements: dict[tuple[str, int, int], tuple[int, int]] = {}
        self.dropped = 0
        self._watch: asyncio.Task[None] | None = None

    @property
    def round_trips(self) -> int:
        return self.remote.round_trips

    def condition(self) -> str:
        return self._condition

    async def start(self) -> None:
        """One probe at start-up: a gateway started while Redis is down says "unreachable" (and
        counts locally) from the start, and the once-a-second recovery turns it "ok"."""
        if self._condition != "ok":
            return
        try:
            await self.remote.ping()
        except self.remote.errors as exc:
            self._lost(exc)

    async def admit(self, key: str, limits: KeyLimits, preset: str, reserve: int = 0) -> Admission:
        """Admits through Redis while it is reachable, mirroring the reservation in this process's
        windows so limits hold for requests in flight if Redis goes away; otherwise admits on the
        local windows alone."""
        if await self._reachable():
            try:
                admission = await self.remote.admit(key, limits, preset, reserve)
            except self.remote.errors as exc:
                self._lost(exc)
            else:
                if admission.reservation is None:
                    return admission
                # This process's windows hold the reservation too: if Redis goes away before the
                # request ends, the limits go on seeing the requests in flight.
                mirror = self.local.reserve(key, admission.reservation.tokens)
                return admission._replace(reservation=admission.reservation._replace(local=mirror.local))
        return await self.local.admit(key, limits, preset, reserve)

    async def charge(
        self, key: str, preset: str, usage: Usage, reservation: Reservation | None = None
    ) -> None:
        """Charges a finished request: always in the local windows, and in Redis when reachable;
        otherwise keeps the usage, and the settlement of a reservation Redis holds, bounded, to add
        to Redis once it answers again."""
        # The local windows always see the tokens: they are what limits rest on during an outage.
        self.local.settle_tokens(key, usage.charged, reservation)
        if await self._reachable():
            try:
                await self.remote.charge(key, preset, usage, reservation)
                return
            except self.remote.errors as exc:
                self._lost(exc)
        held = reservation.redis if reservation is not None else None
        if reservation is not None and held is not None:
            # Redis holds the reservation: it is settled there when it returns, in its buckets.
            self._keep_settlement(key, held, reservation.tokens, usage.charged)
        tokens = 0 if held is not None else usage.charged
        self._keep(day_of(time.time()), key, preset, usage_counts(usage), tokens)

    async def usage(self, days: int = 1) -> UsageTable:
        if await self._reachable():
            try:
                return await self.remote.usage(days)
            except self.remote.errors as exc:
                self._lost(exc)
        # Redis is away: what it held before plus what is kept for it is not known here; the
        # usage kept for replay is what this process can tell.
        today = day_of(time.time())
        total: UsageTable = {}
        for (day, key, preset), counts in self._pending.items():
            if (today - day).days < days:
                add_counts(total, key, preset, counts)
        return total

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if (self._pending or self._settlements) and await self._reachable():
            await self._replay()
        await self.remote.close()

    def _keep(self, day: dt.date, key: str, preset: str, counts: dict[str, int], tokens: int) -> None:
        row = (day, key, preset)
        if row not in self._pending and len(self._pending) >= MAX_PENDING:
            self._drop("usage")
            return
        kept = self._pending.setdefault(row, {})
        for field, value in counts.items():
            kept[field] = kept.get(field, 0) + value
        self._pending_tokens[row] = self._pending_tokens.get(row, 0) + tokens

    def _keep_settlement(self, key: str, buckets: tuple[int, int], reserved: int, charged: int) -> None:
        row = (key, *buckets)
        if row not in self._settlements and len(self._settlements) >= MAX_PENDING:
            # Redis keeps that reservation until its windows slide past it.
            self._drop("settlements")
            return
        before = self._settlements.get(row, (0, 0))
        self._settlements[row] = (before[0] + reserved, before[1] + charged)

    def _drop(self, what: str) -> None:
        self.dropped += 1
        if self.dropped == 1:
            log.error(
                "%s kept for Redis are at their bound (%d rows); newer rows are dropped", what, MAX_PENDING
            )

    async def _reachable(self) -> bool:
        """True while Redis answers; while not, one try a second (the first of them replays the
        usage kept meanwhile, then the condition turns "ok" again)."""
        if self._condition == "ok":
            return True
        if self._monotonic() < self._next_try:
            return False
        self._next_try = self._monotonic() + RETRY_INTERVAL
        try:
            await self._replay()
        except self.remote.errors:
            return False
        self._set("ok")
        return True

    async def _replay(self) -> None:
        await self.remote.ping()
        # Row by row, taken out before the await: charges that arrive meanwhile start a new row.
        while self._settlements:
            (key, minute, day_bucket), (reserved, charged) = next(iter(self._settlements.items()))
            del self._settlements[(key, minute, day_bucket)]
            try:
                # In the reservation's own buckets: the script leaves one that slid out alone.
                today = day_of(time.time())
                await self.remote.settle(today, key, "", {}, (minute, day_bucket), reserved, charged)
            except BaseException:
                self._keep_settlement(key, (minute, day_bucket), reserved, charged)
                raise
        while self._pending:
            row = next(iter(self._pending))
            counts, tokens = self._pending.pop(row), self._pending_tokens.pop(row, 0)
            day, key, preset = row
            try:
                # The minute window has long slid past these tokens; the day's has not.
                await self.remote.add(day, key, preset, counts, tokens, minute=False)
            except BaseException:
                self._keep(day, key, preset, counts, tokens)
                raise
        self.dropped = 0

    def _lost(self, exc: BaseException) -> None:
        log.debug("Redis call failed: %s", type(exc).__name__)
        self._next_try = self._monotonic() + RETRY_INTERVAL
        self._set("unreachable")
        if self._watch is None or self._watch.done():
            self._watch = asyncio.ensure_future(self._until_back())

    async def _until_back(self) -> None:
        """While Redis is away, try it once a second even without traffic: the usage kept
        meanwhile is added, and /ready tells the truth, as soon as it returns."""
        while self._condition != "ok":
            await asyncio.sleep(max(0.0, self._next_try - self._monotonic()) + 0.01)
            await self._reachable()

    def _set(self, condition: str) -> None:
        if condition != self._condition:
            self._condition = condition
            if self._on_condition is not None:
                self._on_condition(condition)


def create_counters(
    redis_url: str | None,
    prefix: str = "fleet-gateway:",
    clock: Callable[[], float] | None = None,
    on_condition: Callable[[str], object] | None = None,
) -> Counters:
    """Local counters without `state.redis`; shared ones, falling back to local, with it."""
    if redis_url is None:
        return LocalCounters(clock)
    return SharedCounters(RedisCounters(redis_url, prefix, clock), LocalCounters(clock), on_condition)
