"""Reservations in the Redis-backed counters, against a real redis-server on 127.0.0.1: two
gateways' admissions see each other's reservations, the end of a request settles in the
reservation's buckets, an outage in between settles locally and in Redis when it is back, and the
condition reported at start-up is the truth."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.team.limits import KeyLimits, Usage
from gateway.team.state import SharedCounters, create_counters
from gateway.team.windows import Reservation
from tests.support.faults import fault_server
from tests.support.gateway_process import GatewayProcess, routes_yaml, wait_until
from tests.support.rawhttp import free_port, http_request
from tests.support.redis import RedisServer, redis_server

PROMPT = 7500
PREFIX = "t:"


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis_db(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as server:
        yield server


def shared(url: str, clock: Clock | None = None, events: list[str] | None = None) -> SharedCounters:
    counters = create_counters(url, PREFIX, clock, events.append if events is not None else None)
    assert isinstance(counters, SharedCounters)
    return counters


def with_counters(count: int, url: str, clock: Clock | None = None) -> Callable[..., Any]:
    """Runs `body(*counters)` in one event loop and closes the counters after."""

    def wrap(body: Callable[..., Awaitable[Any]]) -> Any:
        async def main() -> Any:
            all_counters = [shared(url, clock) for _ in range(count)]
            try:
                return await body(*all_counters)
            finally:
                for counters in all_counters:
                    await counters.close()

        return asyncio.run(main())

    return wrap


def held(server: RedisServer, window: str, key: str = "k") -> dict[int, int]:
    """The buckets Redis holds for a key's token window."""
    client = server.client()
    try:
        return {int(b): int(v) for b, v in client.hgetall(f"{PREFIX}{window}:{key}").items()}
    finally:
        client.close()


def requests_today(server: RedisServer) -> int:
    """Requests in the usage Redis holds, every day and key together."""
    client = server.client()
    try:
        total = 0
        for name in client.keys(f"{PREFIX}usage:*"):
            for field, value in client.hgetall(name).items():
                total += int(value) if str(field).endswith("\x1frequests") else 0
        return total
    finally:
        client.close()


@pytest.mark.parametrize("limit", ["tokens_per_minute", "tokens_per_day"])
def test_twenty_concurrent_admissions_from_two_gateways_admit_exactly_one(
    redis_db: RedisServer, limit: str
) -> None:
    limits = KeyLimits(**{limit: 1000})

    @with_counters(2, redis_db.url)
    async def admitted(a: SharedCounters, b: SharedCounters) -> list[bool]:
        answers = await asyncio.gather(*((a, b)[i % 2].admit("k", limits, "m", PROMPT) for i in range(20)))
        return [answer.denial is None for answer in answers]

    assert admitted.count(True) == 1
    assert sum(held(redis_db, "tpm").values()) == PROMPT
    assert sum(held(redis_db, "tpd").values()) == PROMPT


def test_a_reservation_in_redis_refuses_the_other_gateway_with_the_limit_and_the_wait(
    redis_db: RedisServer,
) -> None:
    clock = Clock()
    limits = KeyLimits(tokens_per_minute=1000)

    @with_counters(2, redis_db.url, clock)
    async def refused(a: SharedCounters, b: SharedCounters) -> Any:
        assert (await a.admit("k", limits, "m", PROMPT)).denial is None
        clock.now += 5
        return (await b.admit("k", limits, "m", 10)).denial

    assert refused is not None
    assert (refused.limit, refused.allowed, refused.used) == ("tokens_per_minute", 1000, PROMPT)
    assert refused.retry_after == pytest.approx(55)


def test_settlement_in_redis_replaces_the_reservation_up_and_down(redis_db: RedisServer) -> None:
    clock = Clock()

    @with_counters(1, redis_db.url, clock)
    async def used(a: SharedCounters) -> list[int]:
        down = await a.admit("k", KeyLimits(), "m", PROMPT)
        up = await a.admit("k", KeyLimits(), "m", 100)
        clock.now += 2
        await a.charge("k", "m", Usage(prompt_tokens=300, completion_tokens=100), down.reservation)
        after_down = sum(held(redis_db, "tpm").values())
        await a.charge("k", "m", Usage(prompt_tokens=250, completion_tokens=250), up.reservation)
        # The other gateway's view: Redis holds the real charges, in the admission's bucket.
        refused = (await a.admit("k", KeyLimits(tokens_per_minute=900), "m")).denial
        assert refused is not None
        return [after_down, refused.used]

    assert used == [400 + 100, 900]
    assert held(redis_db, "tpm") == {1_800_000_000: 900}
    assert held(redis_db, "tpd") == {1_800_000_000 // 60: 900}
    assert requests_today(redis_db) == 2


def test_settlement_after_the_minute_left_the_window_touches_only_the_day_in_redis(
    redis_db: RedisServer,
) -> None:
    clock = Clock()

    @with_counters(1, redis_db.url, clock)
    async def later(a: SharedCounters) -> list[Any]:
        admission = await a.admit("k", KeyLimits(), "m", 100)
        clock.now += 61  # a long answer, longer than it was expected to be
        await a.charge("k", "m", Usage(prompt_tokens=300, completion_tokens=100), admission.reservation)
        untouched = held(redis_db, "tpm")
        return [untouched, (await a.admit("k", KeyLimits(tokens_per_minute=1000), "m")).denial]

    untouched, denial = later
    # The minute's bucket had left the window: the charge did not land in it ...
    assert untouched == {1_800_000_000: 100}
    assert denial is None and held(redis_db, "tpm") == {}  # ... and the next admission dropped it
    # The day's holds the real charge in the reservation's bucket.
    assert held(redis_db, "tpd") == {1_800_000_000 // 60: 400}


def test_a_refused_request_reserves_nothing_in_redis(redis_db: RedisServer) -> None:
    limits = KeyLimits(tokens_per_minute=1000, tokens_per_day=10**6)

    @with_counters(1, redis_db.url)
    async def refusals(a: SharedCounters) -> list[Any]:
        assert (await a.admit("k", limits, "m", 1000)).denial is None
        return [await a.admit("k", limits, "m", PROMPT) for _ in range(3)]

    assert all(r.denial is not None and r.reservation is None for r in refusals)
    assert sum(held(redis_db, "tpm").values()) == 1000
    assert sum(held(redis_db, "tpd").values()) == 1000


def test_one_round_trip_to_reserve_and_one_to_settle(redis_db: RedisServer) -> None:
    limits = KeyLimits(requests_per_minute=100, tokens_per_minute=10**6, tokens_per_day=10**8)

    @with_counters(1, redis_db.url)
    async def trips(a: SharedCounters) -> list[int]:
        warm = await a.admit("warm", limits, "m", 5)  # loads the scripts once
        await a.charge("warm", "m", Usage(prompt_tokens=1), warm.reservation)
        start = a.round_trips
        admission = await a.admit("k", limits, "m", PROMPT)
        after_admit = a.round_trips
        await a.charge("k", "m", Usage(prompt_tokens=5, completion_tokens=5), admission.reservation)
        return [after_admit - start, a.round_trips - after_admit]

    assert trips == [1, 1]


def test_an_absurd_usage_report_is_clamped_and_redis_stays_reachable(redis_db: RedisServer) -> None:
    @with_counters(1, redis_db.url)
    async def condition(a: SharedCounters) -> str:
        admission = await a.admit("k", KeyLimits(tokens_per_minute=1000), "m", 10**30)
        await a.charge("k", "m", Usage(prompt_tokens=10**30, completion_tokens=10**30), admission.reservation)
        return a.condition()

    assert condition == "ok"
    assert 0 < sum(held(redis_db, "tpm").values()) <= 2 * 10**12


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """redis-server stopped by SIGSTOP: it answers nothing (calls time out) and keeps its data."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


async def until_ok(counters: SharedCounters) -> None:
    for _ in range(100):
        if counters.condition() == "ok":
            return
        await asyncio.sleep(0.1)


def test_a_reservation_settled_while_redis_is_away_is_settled_locally_then_in_redis(
    redis_db: RedisServer,
) -> None:
    limits = KeyLimits(tokens_per_minute=1000)
    events: list[str] = []

    async def scenario() -> list[Any]:
        counters = shared(redis_db.url, events=events)
        try:
            first = await counters.admit("k", limits, "m", PROMPT)
            assert first.denial is None
            with paused(redis_db):
                await counters.usage(1)  # a read times out: Redis is away
                assert counters.condition() == "unreachable"
                # This process's windows hold the reservation Redis made: the limit still holds.
                during = (await counters.admit("k", limits, "m", PROMPT)).denial
                await counters.charge(
                    "k", "m", Usage(prompt_tokens=300, completion_tokens=100), first.reservation
                )
                # Settled here: the key is under its limit again.
                after = await counters.admit("k", limits, "m", 0)
                await counters.charge("k", "m", Usage(), after.reservation)
            await until_ok(counters)
            return [during, after.denial, counters.condition()]
        finally:
            await counters.close()

    during, after, condition = asyncio.run(scenario())
    assert during is not None and during.used == PROMPT
    assert after is None
    assert condition == "ok" and events == ["unreachable", "ok"]
    # Redis kept the reservation through the pause; the replay replaced it by the real charge.
    assert sum(held(redis_db, "tpm").values()) == 400
    assert sum(held(redis_db, "tpd").values()) == 400
    assert requests_today(redis_db) == 2


def test_a_reservation_lost_by_a_redis_restart_is_settled_as_the_real_charge(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    limits = KeyLimits(tokens_per_minute=1000)

    async def scenario() -> None:
        counters = shared(server.url)
        try:
            first = await counters.admit("k", limits, "m", PROMPT)
            server.stop()
            assert (await counters.admit("k", limits, "m", PROMPT)).denial is not None
            await counters.charge(
                "k", "m", Usage(prompt_tokens=300, completion_tokens=100), first.reservation
            )
            server.start()  # empty: no persistence
            await until_ok(counters)
            assert counters.condition() == "ok"
        finally:
            await counters.close()

    try:
        asyncio.run(scenario())
        assert sum(held(server, "tpm").values()) == 400
        assert sum(held(server, "tpd").values()) == 400
        assert requests_today(server) == 1
    finally:
        server.stop()


def test_a_reservation_made_during_an_outage_is_charged_to_redis_when_it_is_back(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)  # down when the request is admitted
    limits = KeyLimits(tokens_per_minute=1000)

    async def scenario() -> None:
        counters = shared(server.url)
        try:
            await counters.start()
            admission = await counters.admit("k", limits, "m", PROMPT)
            assert admission.reservation is not None and admission.reservation.redis is None
            server.start()
            await until_ok(counters)
            await counters.charge(
                "k", "m", Usage(prompt_tokens=300, completion_tokens=100), admission.reservation
            )
            # This process's windows settled their own reservation.
            assert (await counters.local.admit("k", limits, "m")).denial is None
        finally:
            await counters.close()

    try:
        asyncio.run(scenario())
        assert sum(held(server, "tpm").values()) == 400
        assert sum(held(server, "tpd").values()) == 400
    finally:
        server.stop()


def test_settlements_kept_for_redis_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gateway.team.state.MAX_PENDING", 5)
    server = RedisServer(tmp_path)  # never started

    async def scenario() -> int:
        counters = shared(server.url)
        try:
            await counters.start()
            for index in range(8):
                # Reservations Redis had made in eight different buckets before it went away.
                reservation = Reservation(100, redis=(1_800_000_000 + index, 30_000_000))
                await counters.charge("k", "m", Usage(prompt_tokens=10), reservation)
            return counters.dropped
        finally:
            await counters.close()

    assert asyncio.run(scenario()) == 3


def test_start_says_unreachable_when_redis_is_down_and_recovers_without_traffic(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    events: list[str] = []

    async def scenario() -> list[str]:
        counters = shared(server.url, events=events)
        try:
            await counters.start()
            seen = [counters.condition()]
            server.start()
            await until_ok(counters)  # no request in between: the once-a-second try flips it
            return [*seen, counters.condition()]
        finally:
            await counters.close()

    try:
        assert asyncio.run(scenario()) == ["unreachable", "ok"]
        assert events == ["unreachable", "ok"]
    finally:
        server.stop()


def test_start_says_ok_when_redis_answers(redis_db: RedisServer) -> None:
    events: list[str] = []

    async def scenario() -> str:
        counters = shared(redis_db.url, events=events)
        try:
            await counters.start()
            return counters.condition()
        finally:
            await counters.close()

    assert asyncio.run(scenario()) == "ok"
    assert events == []


@pytest.mark.slow
def test_a_gateway_started_while_redis_is_down_reports_it_unreachable_until_it_returns(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path)  # its port, nothing listening yet
    with fault_server(name="A") as replica:
        routes = tmp_path / "routes.yaml"
        table = json.loads(routes_yaml([("r0", replica.url)]))
        routes.write_text(json.dumps({**table, "state": {"redis": server.url, "prefix": PREFIX}}))
        gateway = GatewayProcess(routes, free_port())
        try:
            gateway.start()
            first = http_request(gateway.address, "GET", "/ready").json()
            assert first == {"status": "ready", "redis": "unreachable"}
            assert "Redis is unreachable" in gateway.output()
            server.start()
            # No request in between: the once-a-second try finds it.
            assert wait_until(
                lambda: http_request(gateway.address, "GET", "/ready").json().get("redis") == "ok", 10
            )
        finally:
            gateway.stop()
            server.stop()
