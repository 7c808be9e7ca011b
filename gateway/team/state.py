"""The team's counters: in this process, or shared by several gateways through Redis.

With Redis, one request costs two round trips: one script at admission (checks the rate and token
windows, logs the request, hands out the preset's round-robin position) and one when the answer
ended (its tokens into the windows and the day's usage). The time is Redis's own, so gateways on
hosts whose clocks differ still share one window. Every key has a TTL a little past its window.

If Redis fails, `SharedCounters` goes on with this process's windows (the condition turns
"unreachable"), keeps the usage counted meanwhile, and adds it to Redis when a later try (at most
one a second) succeeds.
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
    UsageTable,
    add_counts,
    day_of,
    usage_counts,
)

log = logging.getLogger("gateway.team")

SOCKET_TIMEOUT = 0.5  # s: a Redis slower than this is treated as unreachable, the request goes on
RETRY_INTERVAL = 1.0  # s between tries while unreachable
MAX_PENDING = 4096  # (day, key, preset) rows of usage kept for replay; more is dropped and logged
FIELD_SEP = "\x1f"
DENIALS: tuple[RateLimit, ...] = ("requests_per_minute", "tokens_per_minute", "tokens_per_day")


class Counters(Protocol):
    @property
    def round_trips(self) -> int: ...

    def condition(self) -> str: ...

    async def admit(self, key: str, limits: KeyLimits, preset: str) -> Admission: ...

    async def charge(self, key: str, preset: str, usage: Usage) -> None: ...

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
# ARGV: now ("" = Redis TIME), rpm, tpm, tpd (0 = none), a unique member for the log.
# Returns {0, ticket} or {1|2|3, allowed, used, retry_after_ms}.
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
local ticket = redis.call('INCR', KEYS[4])
redis.call('EXPIRE', KEYS[4], 86400)
return {0, ticket - 1}
"""
)

# KEYS: minute tokens, day tokens, the day's usage (hash). ARGV: now ("" = TIME), tokens,
# whether to count the minute (a replay after an outage does not), then field, value pairs.
_CHARGE = (
    _NOW
    + """
local tokens = tonumber(ARGV[2])
if tokens > 0 then
  if ARGV[3] == '1' then
    redis.call('HINCRBY', KEYS[1], math.floor(now), tokens)
    redis.call('EXPIRE', KEYS[1], 61)
  end
  redis.call('HINCRBY', KEYS[2], math.floor(now / 60), tokens)
  redis.call('EXPIRE', KEYS[2], 86460)
end
for i = 4, #ARGV, 2 do
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

    def _now(self) -> str:
        return "" if self._clock is None else repr(self._clock())

    def _day(self) -> dt.date:
        return day_of(self._clock() if self._clock is not None else time.time())

    async def admit(self, key: str, limits: KeyLimits, preset: str) -> Admission:
        self._member += 1
        p = self.prefix
        keys = [f"{p}rpm:{key}", f"{p}tpm:{key}", f"{p}tpd:{key}", f"{p}ticket:{preset}"]
        args: list[str | int] = [
            self._now(),
            limits.requests_per_minute or 0,
            limits.tokens_per_minute or 0,
            limits.tokens_per_day or 0,
            f"{self._origin}-{self._member}",
        ]
        self.round_trips += 1
        reply: list[Any] = await self._admit(keys=keys, args=args)
        if int(reply[0]) == 0:
            return Admission(None, int(reply[1]))
        limit = DENIALS[int(reply[0]) - 1]
        return Admission(Denial(limit, int(reply[1]), int(reply[2]), max(int(reply[3]), 1) / 1000), 0)

    async def charge(self, key: str, preset: str, usage: Usage) -> None:
        await self.add(self._day(), key, preset, usage_counts(usage), usage.charged, minute=True)

    async def add(
        self, day: dt.date, key: str, preset: str, counts: dict[str, int], tokens: int, minute: bool
    ) -> None:
        p = self.prefix
        keys = [f"{p}tpm:{key}", f"{p}tpd:{key}", f"{p}usage:{day.isoformat()}"]
        args: list[str | int] = [self._now(), tokens, "1" if minute else "0"]
        for field, value in counts.items():
            if value:
                args += [FIELD_SEP.join((key, preset, field)), value]
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


class SharedCounters:
    """Redis while it answers, this process's windows while it does not; usage counted during an
    outage is added to Redis when it returns."""

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
        self.dropped = 0
        self._watch: asyncio.Task[None] | None = None

    @property
    def round_trips(self) -> int:
        return self.remote.round_trips

    def condition(self) -> str:
        return self._condition

    async def admit(self, key: str, limits: KeyLimits, preset: str) -> Admission:
        if await self._reachable():
            try:
                return await self.remote.admit(key, limits, preset)
            except self.remote.errors as exc:
                self._lost(exc)
        return await self.local.admit(key, limits, preset)

    async def charge(self, key: str, preset: str, usage: Usage) -> None:
        # The local windows always see the tokens: they are what limits rest on during an outage.
        self.local.count_tokens(key, usage.charged)
        if await self._reachable():
            try:
                await self.remote.charge(key, preset, usage)
                return
            except self.remote.errors as exc:
                self._lost(exc)
        self._keep(day_of(time.time()), key, preset, usage_counts(usage), usage.charged)

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
        if self._pending and await self._reachable():
            await self._replay()
        await self.remote.close()

    def _keep(self, day: dt.date, key: str, preset: str, counts: dict[str, int], tokens: int) -> None:
        row = (day, key, preset)
        if row not in self._pending and len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            if self.dropped == 1:
                log.error(
                    "usage kept for Redis is at its bound (%d rows); newer rows are dropped", MAX_PENDING
                )
            return
        kept = self._pending.setdefault(row, {})
        for field, value in counts.items():
            kept[field] = kept.get(field, 0) + value
        self._pending_tokens[row] = self._pending_tokens.get(row, 0) + tokens

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
