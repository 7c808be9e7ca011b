"""Sliding windows kept in this process: the counters of a gateway without Redis, and the ones a
gateway falls back to while Redis is unreachable.

Requests per minute keep an exact log of admission times (at most `limit` entries per key, since
nothing is logged past the limit). Token windows are buckets: 1 s wide over the minute, 60 s wide
over the day, so a key costs at most 60 + 1440 small integers whatever its traffic. Usage is kept
per UTC day for the last 35 days. Pure bookkeeping over a clock; the owners do the I/O.

A request's tokens are counted in two steps, so that concurrent requests see each other:
- at admission, `admit(key, limits, preset, reserve=N)` refuses when a window is already at or over
  its limit (one request may still overshoot an empty window), and otherwise counts the N tokens
  the request is expected to cost in the current bucket of each token window at once; the
  `Admission` it returns carries a `Reservation` saying which buckets;
- at the end, `charge(key, preset, usage, reservation)` replaces the reservation by the real
  charge (`usage.charged`: prompt + completion as reported, or what was counted of a cut stream)
  in those same buckets (one that left its window is not touched) and counts the usage. A request
  that never reached a replica is charged `Usage()`: its reservation is released.
`charge` without a reservation counts the tokens in the current buckets, as before reservations.
"""

from __future__ import annotations

import collections
import datetime as dt
import itertools
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from gateway.team.limits import DAY, MINUTE, USAGE_FIELDS, Denial, KeyLimits, RateLimit, Usage

KEEP_DAYS = 35
# (window, bucket width): the minute in seconds, the day in minutes.
TOKEN_WINDOWS: dict[RateLimit, tuple[float, float]] = {
    "tokens_per_minute": (MINUTE, 1.0),
    "tokens_per_day": (DAY, 60.0),
}

UsageTable = dict[str, dict[str, dict[str, int]]]  # key -> preset -> field -> count


# Named tuples, as Usage: both are made on every admission of a key with token limits.
class Reservation(NamedTuple):
    """The tokens an admitted request was expected to cost and the buckets they were counted in:
    (minute bucket, day bucket) of this process's windows and, when Redis admitted it, of Redis's
    (whose clock may differ). Handed back unchanged to `charge` when the request ends."""

    tokens: int
    local: tuple[int, int] | None = None
    redis: tuple[int, int] | None = None


class Admission(NamedTuple):
    """The counters' answer to one request: refused (and why), or admitted with a round-robin
    position for the preset and the reservation its `charge` settles."""

    denial: Denial | None
    ticket: int
    reservation: Reservation | None = None


def day_of(now: float) -> dt.date:
    return dt.datetime.fromtimestamp(now, dt.UTC).date()


def usage_counts(usage: Usage) -> dict[str, int]:
    return {"requests": 1, **usage._asdict()}


def add_counts(table: UsageTable, key: str, preset: str, counts: dict[str, int]) -> None:
    presets = table.setdefault(key, {})
    fields = presets.get(preset)
    if fields is None:  # once per key, preset and day: not a new dict per answer, as setdefault's default
        fields = presets[preset] = dict.fromkeys(USAGE_FIELDS, 0)
    for field, value in counts.items():
        fields[field] = fields.get(field, 0) + value


def token_retry(
    buckets: Iterable[tuple[int, int]], used: int, allowed: int, span: int, width: float, now: float
) -> float:
    """Seconds until the window's sum falls below `allowed`, oldest buckets leaving first.

    A bucket `b` covers [b*width, (b+1)*width) and counts while b > current - span, i.e. until
    (b + span) * width."""
    for index, tokens in sorted(buckets):
        used -= tokens
        if used < allowed:
            return max((index + span) * width - now, 0.001)
    return width  # not reached: every bucket leaves within the window


class TokenWindow:
    """One key's token sum over a sliding window, in buckets.

    Asked three or four times per request of a key with token limits. Buckets leave the window only
    when the current bucket changes, so the window is pruned once per bucket width, and the sum is
    kept as the buckets change: scanning a day's 1,440 buckets on every call cost 170 us per request
    once a key had been busy for a day (tests/team/test_windows.py holds it to the plain rule)."""

    def __init__(self, window: float, width: float) -> None:
        self.width = width
        self.span = round(window / width)
        self._buckets: dict[int, int] = {}
        self._total = 0  # the sum of the buckets
        self._pruned_at: int | None = None  # the current bucket when the window was last pruned

    def bucket(self, now: float) -> int:
        return int(now // self.width)

    def _prune(self, now: float) -> int:
        """Drops the buckets that left the window; returns the current bucket. No bucket older than
        the window is added between two prunes: `add` counts in the current bucket and `settle`
        only in one still inside the window."""
        current = int(now // self.width)  # self.bucket(now), without a call
        if current != self._pruned_at:
            self._pruned_at = current
            oldest = current - self.span + 1
            for index in [i for i in self._buckets if i < oldest]:
                self._total -= self._buckets.pop(index)
        return current

    def add(self, tokens: int, now: float) -> int:
        """Counts `tokens` in the current bucket; returns that bucket."""
        index = int(now // self.width)
        # The bucket is worked out here and `_prune` called only when it changed: a request makes
        # six calls like this one, and the bucket changes once a second at most.
        if index != self._pruned_at:
            self._prune(now)
        if tokens:
            self._buckets[index] = self._buckets.get(index, 0) + tokens
            self._total += tokens
        return index

    def settle(self, index: int, reserved: int, charged: int, now: float) -> None:
        """Replaces `reserved` tokens counted in bucket `index` by `charged`. A bucket that left
        the window is not touched: what it held no longer limits anyone."""
        current = int(now // self.width)
        if current != self._pruned_at:
            self._prune(now)
        if index <= current - self.span:
            return
        held = self._buckets.get(index, 0)
        value = held + charged - reserved
        if value > 0:
            self._buckets[index] = value
            self._total += value - held
        elif index in self._buckets:
            self._total -= self._buckets.pop(index)

    def used(self, now: float) -> int:
        if int(now // self.width) != self._pruned_at:
            self._prune(now)
        return self._total

    def retry_after(self, allowed: int, now: float) -> float:
        return token_retry(self._buckets.items(), self.used(now), allowed, self.span, self.width, now)


class LocalCounters:
    """Counters of one process; `condition()` says "local" so /ready and metrics can tell."""

    round_trips = 0

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.time
        self._requests: dict[str, collections.deque[float]] = {}
        self._tokens: dict[str, dict[RateLimit, TokenWindow]] = {}
        self._tickets: dict[str, itertools.count[int]] = {}
        self._days: dict[dt.date, UsageTable] = {}
        self._day: tuple[int, dt.date] = (-1, dt.date.min)  # the current UTC day, looked up once a day

    def condition(self) -> str:
        return "local"

    async def start(self) -> None:
        return None

    def check(self, key: str, limits: KeyLimits) -> Denial | None:
        return self._check(key, limits, self._clock())

    def _check(self, key: str, limits: KeyLimits, now: float) -> Denial | None:
        # The longest window first, as the Redis script checks them: the refusal that lasts.
        windows = None
        for limit, allowed in reversed(limits.rates):
            if limit == "requests_per_minute":
                log = self._request_log(key, now)
                if len(log) >= allowed:
                    return Denial(limit, allowed, len(log), max(log[0] + MINUTE - now, 0.001))
            else:
                windows = windows or self._windows(key)
                window = windows[limit]
                used = window.used(now)
                if used >= allowed:
                    return Denial(limit, allowed, used, window.retry_after(allowed, now))
        return None

    async def admit(self, key: str, limits: KeyLimits, preset: str, reserve: int = 0) -> Admission:
        """Checks the key's limits; if none is reached, logs the request and reserves `reserve`
        tokens in its token windows (no await in between: concurrent admissions see each other)."""
        if not limits.counted:
            return Admission(None, self.next_ticket(preset))  # nothing to check, count or reserve
        now = self._clock()  # one reading for the check, the log and the reservation
        denial = self._check(key, limits, now)
        if denial is not None:
            return Admission(denial, 0)
        if limits.requests_per_minute is not None:
            self._request_log(key, now).append(now)
        reservation = self._reserve(key, reserve, now) if limits.tokens else None
        return Admission(None, self.next_ticket(preset), reservation)

    def reserve(self, key: str, tokens: int) -> Reservation:
        """Counts `tokens` in the key's token windows now, unchecked (`admit` checks first; the
        shared counters mirror here what Redis admitted)."""
        return self._reserve(key, tokens, self._clock())

    def _reserve(self, key: str, tokens: int, now: float) -> Reservation:
        windows = self._windows(key)
        tokens = max(0, tokens)
        minute = windows["tokens_per_minute"].add(tokens, now)
        day = windows["tokens_per_day"].add(tokens, now)
        return Reservation(tokens, local=(minute, day))

    def settle_tokens(self, key: str, charged: int, reservation: Reservation | None) -> None:
        """The request's real tokens in place of its reservation (or, without one, in the current
        buckets)."""
        if reservation is None or reservation.local is None:
            self.count_tokens(key, charged)
            return
        now = self._clock()
        windows = self._windows(key)
        minute, day = reservation.local
        windows["tokens_per_minute"].settle(minute, reservation.tokens, charged, now)
        windows["tokens_per_day"].settle(day, reservation.tokens, charged, now)

    def next_ticket(self, preset: str) -> int:
        return next(self._tickets.setdefault(preset, itertools.count()))

    def count_tokens(self, key: str, tokens: int, limits: Iterable[RateLimit] = TOKEN_WINDOWS) -> None:
        """Counts `tokens` in the key's token windows, where it has any (a key without a token
        limit, whose admissions reserve nothing, keeps none)."""
        windows = self._tokens.get(key)
        if windows is None:
            return
        now = self._clock()
        for limit in limits:
            windows[limit].add(tokens, now)

    async def charge(
        self, key: str, preset: str, usage: Usage, reservation: Reservation | None = None
    ) -> None:
        self.charge_now(key, preset, usage, reservation)

    def charge_now(self, key: str, preset: str, usage: Usage, reservation: Reservation | None = None) -> None:
        """`charge` without a wait: in this process nothing needs one."""
        self.settle_tokens(key, usage.charged, reservation)
        table = self._days.get(self._today())
        fields = table.get(key, {}).get(preset) if table is not None else None
        if fields is None:  # the first answer of the key and preset today
            self.add_usage(self._today(), key, preset, usage_counts(usage))
            return
        # The day's counts in place: what add_usage does, without a dict per answer to do it with.
        fields["requests"] += 1
        for name, value in zip(Usage._fields, usage, strict=True):
            fields[name] += value

    def _today(self) -> dt.date:
        day = int(self._clock() // DAY)
        if day != self._day[0]:
            self._day = (day, day_of(self._clock()))
        return self._day[1]

    def add_usage(self, day: dt.date, key: str, preset: str, counts: dict[str, int]) -> None:
        table = self._days.get(day)
        if table is None:
            table = self._days[day] = {}
            # A new day: the oldest beyond the kept ones go (looked for once a day, not per answer).
            oldest = self._today() - dt.timedelta(days=KEEP_DAYS - 1)
            for old in [d for d in self._days if d < oldest]:
                del self._days[old]
        add_counts(table, key, preset, counts)

    async def usage(self, days: int = 1) -> UsageTable:
        today = day_of(self._clock())
        total: UsageTable = {}
        for day, table in self._days.items():
            if (today - day).days < days:
                for key, presets in table.items():
                    for preset, counts in presets.items():
                        add_counts(total, key, preset, counts)
        return total

    async def close(self) -> None:
        return None

    def _request_log(self, key: str, now: float) -> collections.deque[float]:
        log = self._requests.get(key)
        if log is None:  # not setdefault: its default would be a new deque on every call
            log = self._requests[key] = collections.deque()
        while log and log[0] <= now - MINUTE:
            log.popleft()
        return log

    def _windows(self, key: str) -> dict[RateLimit, TokenWindow]:
        windows = self._tokens.get(key)
        if windows is None:
            windows = {limit: TokenWindow(*shape) for limit, shape in TOKEN_WINDOWS.items()}
            self._tokens[key] = windows
        return windows
