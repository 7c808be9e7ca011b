"""The team's counters: local sliding windows over a fake clock, and the Redis-backed ones against
a real redis-server on 127.0.0.1 (two instances sharing it, restarts, the usage kept meanwhile)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.team.limits import KeyLimits, Usage
from gateway.team.state import RedisCounters, SharedCounters, create_counters
from gateway.team.windows import LocalCounters, token_retry
from tests.support.redis import RedisServer, redis_server


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


# -- local windows ------------------------------------------------------------------------------


def test_requests_per_minute_slide_and_say_when_to_retry() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(requests_per_minute=3)

    async def scenario() -> None:
        for _ in range(3):
            assert (await counters.admit("alice", limits, "m")).denial is None
            clock.now += 10
        refused = await counters.admit("alice", limits, "m")
        assert refused.denial is not None
        assert (refused.denial.limit, refused.denial.allowed, refused.denial.used) == (
            "requests_per_minute",
            3,
            3,
        )
        # The first request was 30 s ago: the window frees a place 30 s from now, not at a clock minute.
        assert refused.denial.retry_after == pytest.approx(30)
        clock.now += 30
        assert (await counters.admit("alice", limits, "m")).denial is None
        # Another key has its own window.
        assert (await counters.admit("bob", limits, "m")).denial is None

    run(scenario())


def test_refused_requests_are_not_counted() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(requests_per_minute=1)

    async def scenario() -> None:
        assert (await counters.admit("a", limits, "m")).denial is None
        for _ in range(5):
            assert (await counters.admit("a", limits, "m")).denial is not None
        clock.now += 60.5
        assert (await counters.admit("a", limits, "m")).denial is None

    run(scenario())


def test_token_limits_count_prompt_and_completion_after_the_answer() -> None:
    clock = Clock()
    counters = LocalCounters(clock)
    limits = KeyLimits(tokens_per_minute=1000, tokens_per_day=5000)

    async def scenario() -> None:
        assert (await counters.admit("a", limits, "m")).denial is None
        # One answer crosses the limit: it was admitted and is charged whole (never cut) ...
        await counters.charge("a", "m", Usage(prompt_tokens=700, cached_tokens=500, completion_tokens=400))
        clock.now += 20
        refused = (await counters.admit("a", limits, "m")).denial
        assert refused is not None and refused.limit == "tokens_per_minute"
        assert (refused.allowed, refused.used) == (1000, 1100)  # cached tokens are part of the prompt
        assert 39 <= refused.retry_after <= 41
        clock.now += refused.retry_after
        assert (await counters.admit("a", limits, "m")).denial is None

        # ... and the day's window holds them for 24 h.
        for _ in range(4):
            await counters.charge("a", "m", Usage(prompt_tokens=1000))
            clock.now += 61
        day = (await counters.admit("a", limits, "m")).denial
        assert day is not None and day.limit == "tokens_per_day" and day.used == 5100
        # The first answer, 304 s ago, leaves the day's window first (to the minute it fell in).
        assert day.retry_after == pytest.approx(86400 - 304, abs=60)

    run(scenario())


def test_token_retry_waits_for_enough_buckets_to_leave() -> None:
    # Buckets of 1 s over 60: 300 tokens at second 10, 300 at second 20; allowed 400.
    assert token_retry([(20, 300), (10, 300)], 600, 400, 60, 1.0, 30.0) == pytest.approx(40)
    # Below the limit only after both leave.
    assert token_retry([(20, 300), (10, 300)], 600, 100, 60, 1.0, 30.0) == pytest.approx(50)


def test_usage_is_kept_per_utc_day() -> None:
    clock = Clock(dt.datetime(2026, 12, 1, 23, 59, tzinfo=dt.UTC).timestamp())
    counters = LocalCounters(clock)

    async def scenario() -> None:
        await counters.charge("a", "dense", Usage(prompt_tokens=10, completion_tokens=5, reasoning_tokens=2))
        clock.now += 120  # the next UTC day
        await counters.charge("a", "dense", Usage(prompt_tokens=1, cached_tokens=1, completion_tokens=1))
        await counters.charge("b", "moe", Usage(prompt_tokens=3))
        today = await counters.usage(1)
        assert today["a"]["dense"] == {
            "requests": 1,
            "prompt_tokens": 1,
            "cached_tokens": 1,
            "completion_tokens": 1,
            "reasoning_tokens": 0,
        }
        both = await counters.usage(2)
        assert both["a"]["dense"]["requests"] == 2 and both["a"]["dense"]["prompt_tokens"] == 11
        assert both["b"]["moe"]["prompt_tokens"] == 3
        clock.now += 40 * 86400  # kept 35 days, then forgotten
        assert await counters.usage(35) == {}

    run(scenario())


def test_tickets_count_per_preset() -> None:
    counters = LocalCounters()

    async def scenario() -> list[int]:
        none = KeyLimits()
        return [(await counters.admit("a", none, p)).ticket for p in ("m", "m", "n", "m")]

    assert run(scenario()) == [0, 1, 0, 2]


def test_without_redis_the_counters_are_local() -> None:
    counters = create_counters(None)
    assert counters.condition() == "local"
    assert counters.round_trips == 0


# -- Redis ----------------------------------------------------------------------------------------


@pytest.fixture
def redis_db(tmp_path: Path) -> Any:
    with redis_server(tmp_path) as server:
        yield server


def shared(url: str, events: list[str] | None = None, prefix: str = "t:") -> SharedCounters:
    counters = create_counters(url, prefix, on_condition=(events.append if events is not None else None))
    assert isinstance(counters, SharedCounters)
    return counters


def with_counters(*urls: str, events: list[str] | None = None) -> Callable[..., Any]:
    """Runs `body(*counters)` in one event loop and closes the counters after."""

    def wrap(body: Callable[..., Awaitable[Any]]) -> Any:
        async def main() -> Any:
            all_counters = [shared(url, events) for url in urls]
            try:
                return await body(*all_counters)
            finally:
                for counters in all_counters:
                    await counters.close()

        return asyncio.run(main())

    return wrap


def test_two_instances_share_a_rate_limit_exactly(redis_db: RedisServer) -> None:
    limits = KeyLimits(requests_per_minute=7)

    @with_counters(redis_db.url, redis_db.url)
    async def outcome(a: SharedCounters, b: SharedCounters) -> list[bool]:
        answers = []
        for index in range(8):
            counters = (a, b)[index % 2]
            answers.append((await counters.admit("alice", limits, "m")).denial is None)
        return answers

    assert outcome == [True] * 7 + [False]


def test_a_refusal_from_redis_names_the_limit_and_the_wait(redis_db: RedisServer) -> None:
    limits = KeyLimits(requests_per_minute=2, tokens_per_minute=100)

    @with_counters(redis_db.url, redis_db.url)
    async def outcome(a: SharedCounters, b: SharedCounters) -> Any:
        await a.admit("k", limits, "m")
        await b.charge("k", "m", Usage(prompt_tokens=80, completion_tokens=30))
        tokens = (await a.admit("k", limits, "m")).denial
        other = (await a.admit("other", limits, "m")).denial
        return tokens, other

    tokens, other = outcome
    assert tokens is not None and tokens.limit == "tokens_per_minute"
    assert (tokens.allowed, tokens.used) == (100, 110)
    assert 0 < tokens.retry_after <= 60
    assert other is None


def test_tickets_are_shared_between_instances(redis_db: RedisServer) -> None:
    @with_counters(redis_db.url, redis_db.url)
    async def tickets(a: SharedCounters, b: SharedCounters) -> list[int]:
        none = KeyLimits()
        return [(await c.admit("x", none, "m")).ticket for c in (a, b, a, b, b)]

    assert tickets == [0, 1, 2, 3, 4]


def test_one_round_trip_to_admit_and_one_to_charge(redis_db: RedisServer) -> None:
    limits = KeyLimits(requests_per_minute=100, tokens_per_minute=10**6, tokens_per_day=10**8)

    @with_counters(redis_db.url)
    async def trips(a: SharedCounters) -> list[int]:
        await a.admit("warm", limits, "m")  # loads the script once
        await a.charge("warm", "m", Usage(prompt_tokens=1))
        start = a.round_trips
        await a.admit("k", limits, "m")
        after_admit = a.round_trips
        await a.charge("k", "m", Usage(prompt_tokens=5, completion_tokens=5))
        return [after_admit - start, a.round_trips - after_admit]

    assert trips == [1, 1]


def test_usage_survives_the_process_and_every_key_has_a_ttl(redis_db: RedisServer) -> None:
    @with_counters(redis_db.url)
    async def first(a: SharedCounters) -> None:
        await a.admit("k", KeyLimits(requests_per_minute=5, tokens_per_minute=1000), "dense")
        await a.charge(
            "k", "dense", Usage(prompt_tokens=12, cached_tokens=8, completion_tokens=3, reasoning_tokens=1)
        )
        await a.charge("k", "dense", Usage(prompt_tokens=1))

    @with_counters(redis_db.url)
    async def later(b: SharedCounters) -> Any:
        return await b.usage(7)

    assert later == {
        "k": {
            "dense": {
                "requests": 2,
                "prompt_tokens": 13,
                "cached_tokens": 8,
                "completion_tokens": 3,
                "reasoning_tokens": 1,
            }
        }
    }
    client = redis_db.client()
    try:
        names = client.keys("t:*")
        assert {n.split(":")[1] for n in names} == {"rpm", "tpm", "tpd", "ticket", "usage"}
        for name in names:
            assert client.ttl(name) > 0, name
    finally:
        client.close()


def test_an_unreachable_redis_falls_back_to_local_and_replays_usage(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    events: list[str] = []
    limits = KeyLimits(requests_per_minute=50)

    async def scenario() -> Any:
        counters = shared(server.url, events)
        try:
            assert (await counters.admit("k", limits, "m")).denial is None
            await counters.charge("k", "m", Usage(prompt_tokens=10, completion_tokens=1))
            assert counters.condition() == "ok"

            server.stop()
            # Every request is still answered: from this process's windows.
            for _ in range(3):
                assert (await counters.admit("k", limits, "m")).denial is None
                await counters.charge("k", "m", Usage(prompt_tokens=100, completion_tokens=10))
            assert counters.condition() == "unreachable"

            server.start()
            # The next try after the retry interval reconnects and adds what was counted meanwhile.
            deadline = asyncio.get_running_loop().time() + 10
            while counters.condition() != "ok" and asyncio.get_running_loop().time() < deadline:
                await counters.admit("k", limits, "m")
                await asyncio.sleep(0.1)
            assert counters.condition() == "ok"
            return await counters.usage(1)
        finally:
            await counters.close()
            server.stop()

    usage = asyncio.run(scenario())
    assert events == ["unreachable", "ok"]
    # Redis restarted empty (no persistence): what it holds now is exactly the replayed usage.
    assert usage["k"]["m"]["requests"] == 3
    assert usage["k"]["m"]["prompt_tokens"] == 300
    assert usage["k"]["m"]["completion_tokens"] == 30


def test_local_limits_hold_while_redis_is_away(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)  # never started: unreachable from the first call
    limits = KeyLimits(requests_per_minute=2)

    async def scenario() -> list[bool]:
        counters = shared(server.url)
        try:
            return [(await counters.admit("k", limits, "m")).denial is None for _ in range(3)]
        finally:
            await counters.close()

    assert asyncio.run(scenario()) == [True, True, False]


def test_redis_counters_raise_their_errors_for_the_caller_to_handle(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)

    async def scenario() -> None:
        counters = RedisCounters(server.url, "t:")
        try:
            with pytest.raises(counters.errors):
                await counters.admit("k", KeyLimits(), "m")
        finally:
            await counters.close()

    asyncio.run(scenario())
