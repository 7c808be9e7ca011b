"""gateway/fleet/replicas.py: picking, admission with a bounded queue, releases that wake waiters,
and a Fleet rebuilt on reload that keeps the state of replicas that stayed the same."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import GatewayTimeout, QueueFull
from gateway.fleet.health import HealthState, Status
from gateway.fleet.replicas import Fleet, Pool, PoolRetired, Replica
from gateway.routing.balancer import Pick
from gateway.routing.table import Health, ReplicaSpec, parse_table

A, B, C = "http://127.0.0.1:9201", "http://127.0.0.1:9202", "http://127.0.0.1:9203"


def table(
    replicas: str = f'{{name: a, url: "{A}", engine: vllm}}, {{name: b, url: "{B}", engine: vllm}}',
    max_in_flight: int = 1,
    queue: int = 4,
    extra: str = "",
) -> str:
    return f"""
presets:
  m:
    served_model: m
    limits: {{max_in_flight: {max_in_flight}, queue: {queue}, queue_timeout: 3600}}
    replicas: [{replicas}]
{extra}
routing: {{default: m}}
"""


def fleet(text: str | None = None, previous: Fleet | None = None) -> Fleet:
    return Fleet(parse_table(text or table()), clock=lambda: 0.0, previous=previous)


def named(pool: Pool, name: str) -> Replica:
    replica = pool.get(name)
    assert replica is not None
    return replica


async def settle() -> None:
    """Let every task that can run, run (scheduling only: no time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


# --- pick -------------------------------------------------------------------------------------


def test_pick_rotates_by_ticket_and_leaves_out_excluded_replicas() -> None:
    pool = fleet().pools["m"]
    assert pool.pick(0).order == ("a", "b")
    assert pool.pick(1).order == ("b", "a")
    assert pool.pick(0, exclude=["a"]).order == ("b",)
    assert pool.pick(0, exclude=["a", "b"]).order == ()


def test_pick_puts_a_down_replica_last() -> None:
    pool = fleet().pools["m"]
    named(pool, "a").health.on_probe("fail", 0.0)
    pick = pool.pick(0)
    assert pick.order == ("b", "a") and pick.reason == "round_robin"
    assert not pool.panic()
    named(pool, "b").health.on_probe("fail", 0.0)
    assert pool.panic() and pool.pick(0).reason == "panic"


def test_tickets_count_up() -> None:
    pool = fleet().pools["m"]
    assert [pool.ticket() for _ in range(3)] == [0, 1, 2]


# --- admit and release ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_admit_leases_the_first_replica_of_the_pick_with_a_free_place() -> None:
    pool = fleet().pools["m"]
    first = await pool.admit(Pick(("a", "b"), "round_robin"), 100.0)
    assert first.name == "a" and first.in_flight == 1
    second = await pool.admit(Pick(("a", "b"), "round_robin"), 100.0)
    assert second.name == "b" and second.in_flight == 1  # a is full (max_in_flight 1)
    pool.release(first)
    assert first.in_flight == 0 and pool.queued == 0


@pytest.mark.anyio
async def test_a_full_queue_answers_429_with_retry_after() -> None:
    pool = fleet(table(queue=1)).pools["m"]
    both = Pick(("a", "b"), "round_robin")
    await pool.admit(both, 100.0)
    await pool.admit(both, 100.0)
    waiting = asyncio.create_task(pool.admit(both, 100.0))
    await settle()
    assert pool.queued == 1
    with pytest.raises(QueueFull) as caught:
        await pool.admit(both, 100.0)
    assert caught.value.status == 429 and caught.value.headers == {"retry-after": "1"}
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert pool.queued == 0


@pytest.mark.anyio
async def test_no_queue_means_429_at_once() -> None:
    pool = fleet(table(queue=0)).pools["m"]
    both = Pick(("a", "b"), "round_robin")
    await pool.admit(both, 100.0)
    await pool.admit(both, 100.0)
    with pytest.raises(QueueFull):
        await pool.admit(both, 100.0)


@pytest.mark.anyio
async def test_a_release_hands_the_place_to_a_waiter() -> None:
    pool = fleet().pools["m"]
    both = Pick(("a", "b"), "round_robin")
    a = await pool.admit(both, 100.0)
    await pool.admit(both, 100.0)
    waiting = asyncio.create_task(pool.admit(both, 100.0))
    await settle()
    assert not waiting.done() and pool.queued == 1
    pool.release(a)
    await settle()
    assert waiting.done() and waiting.result() is a
    assert a.in_flight == 1 and pool.queued == 0


@pytest.mark.anyio
async def test_a_waiter_past_its_deadline_gets_a_queue_timeout() -> None:
    pool = fleet().pools["m"]
    both = Pick(("a", "b"), "round_robin")
    await pool.admit(both, 100.0)
    await pool.admit(both, 100.0)
    with pytest.raises(GatewayTimeout) as caught:
        await pool.admit(both, -1.0)  # the request's deadline is already behind it (clock reads 0)
    assert caught.value.code == "queue_timeout" and pool.queued == 0


@pytest.mark.anyio
async def test_a_release_reaches_a_waiter_that_can_use_the_freed_replica() -> None:
    pool = fleet().pools["m"]
    a = await pool.admit(Pick(("a",), "round_robin"), 100.0)
    b = await pool.admit(Pick(("b",), "round_robin"), 100.0)
    wants_a = asyncio.create_task(pool.admit(Pick(("a",), "round_robin"), 100.0))
    wants_b = asyncio.create_task(pool.admit(Pick(("b",), "round_robin"), 100.0))
    await settle()
    pool.release(b)
    await settle()
    try:
        assert wants_b.done() and wants_b.result() is b
        assert not wants_a.done() and a.in_flight == 1
    finally:
        for task in (wants_a, wants_b):
            task.cancel()
        await asyncio.gather(wants_a, wants_b, return_exceptions=True)


@pytest.mark.anyio
async def test_a_wakeup_is_passed_on_when_the_woken_waiter_is_cancelled() -> None:
    pool = fleet().pools["m"]
    both = Pick(("a", "b"), "round_robin")
    a = await pool.admit(both, 100.0)
    await pool.admit(both, 100.0)
    first = asyncio.create_task(pool.admit(both, 100.0))
    second = asyncio.create_task(pool.admit(both, 100.0))
    await settle()
    pool.release(a)
    first.cancel()
    await settle()
    try:
        assert second.done() and second.result() is a
    finally:
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)


# --- Replica ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "spec_limit", "slots", "limit"),
    [
        ("llamacpp", None, 4, 6),  # llama-server's HTTP threads: slots + 2
        ("llamacpp", None, 100, 8),  # never above the preset's limit
        ("llamacpp", None, None, 8),  # slots not read yet
        ("llamacpp", 3, 4, 3),  # the table's own number wins
        ("vllm", None, 4, 8),  # slots mean nothing for vLLM
    ],
)
def test_replica_limit(engine: str, spec_limit: int | None, slots: int | None, limit: int) -> None:
    spec = ReplicaSpec(name="r", url=A, engine=engine, max_in_flight=spec_limit)  # type: ignore[arg-type]
    replica = Replica(spec=spec, health=HealthState(Health()), max_in_flight=spec_limit or 8, preset="m")
    replica.slots = slots
    assert replica.limit == limit


def test_replica_key_is_read_from_the_environment_at_use(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ReplicaSpec(name="r", url=A, engine="vllm", api_key_env="FLEET_TEST_KEY")
    replica = Replica(spec=spec, health=HealthState(Health()), max_in_flight=1, preset="m")
    monkeypatch.delenv("FLEET_TEST_KEY", raising=False)
    assert replica.api_key() is None
    monkeypatch.setenv("FLEET_TEST_KEY", "first")
    assert replica.api_key() == "first"
    monkeypatch.setenv("FLEET_TEST_KEY", "rotated")
    assert replica.api_key() == "rotated"


# --- Fleet ------------------------------------------------------------------------------------


def test_a_reload_keeps_the_state_of_a_replica_with_the_same_name_url_and_engine() -> None:
    before = fleet()
    a = named(before.pools["m"], "a")
    a.in_flight, a.context, a.slots = 1, 4096, 2
    a.health.on_probe("ok", 0.0)
    after = fleet(table(max_in_flight=5), previous=before)
    kept = named(after.pools["m"], "a")
    assert kept is a
    assert (kept.in_flight, kept.context, kept.slots, kept.health.status) == (1, 4096, 2, Status.UP)
    assert kept.max_in_flight == 5  # the new table's limit applies


@pytest.mark.parametrize(
    "changed",
    [
        f'{{name: a, url: "{C}", engine: vllm}}, {{name: b, url: "{B}", engine: vllm}}',
        f'{{name: a, url: "{A}", engine: llamacpp}}, {{name: b, url: "{B}", engine: vllm}}',
    ],
    ids=["new-url", "new-engine"],
)
def test_a_reload_starts_afresh_a_replica_whose_url_or_engine_changed(changed: str) -> None:
    before = fleet()
    a = named(before.pools["m"], "a")
    a.in_flight, a.context = 1, 4096
    a.health.on_probe("ok", 0.0)
    after = fleet(table(changed), previous=before)
    fresh = named(after.pools["m"], "a")
    assert fresh is not a
    assert (fresh.in_flight, fresh.context, fresh.health.status) == (0, None, Status.UNKNOWN)
    assert named(after.pools["m"], "b") is named(before.pools["m"], "b")


def test_a_reload_drops_a_replica_no_longer_listed() -> None:
    before = fleet()
    after = fleet(table(f'{{name: b, url: "{B}", engine: vllm}}'), previous=before)
    assert [r.name for r in after.replicas()] == ["b"]


@pytest.mark.anyio
async def test_a_reload_sends_the_old_pools_waiters_to_pick_again() -> None:
    before = fleet()
    pool = before.pools["m"]
    both = Pick(("a", "b"), "round_robin")
    a = await pool.admit(both, 100.0)
    await pool.admit(both, 100.0)
    waiting = asyncio.create_task(pool.admit(both, 100.0))
    await settle()
    a.in_flight = 0  # a place is free in the old pool, but the table it came from is gone
    fleet(previous=before)
    await settle()
    assert waiting.done() and isinstance(waiting.exception(), PoolRetired)
    with pytest.raises(PoolRetired):  # and a request that picked from the old fleet a moment ago
        await pool.admit(both, 100.0)


def test_a_replica_in_two_presets_is_one_replica() -> None:
    shared = table(
        extra=f"""
  n:
    served_model: n
    replicas: [{{name: a, url: "{A}", engine: vllm}}]
"""
    )
    both = fleet(shared)
    assert named(both.pools["m"], "a") is named(both.pools["n"], "a")
    assert sorted(r.name for r in both.replicas()) == ["a", "b"]


def test_not_ready_names_presets_without_a_ready_replica() -> None:
    both = fleet()
    assert both.not_ready() == ["m"]  # nothing probed yet
    named(both.pools["m"], "b").health.on_probe("ok", 0.0)
    assert both.not_ready() == []
