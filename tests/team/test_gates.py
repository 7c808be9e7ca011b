"""gateway/team/gates.py: a key's `concurrent` places: taken at once while free, waited for in
arrival order when not, handed on by `leave`, and given back by a waiter that gives up."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import QueueFull, QueueTimeout
from gateway.team.gates import Gate

LONG = 3600.0  # a queue timeout no test reaches: every wait here ends by an event


def entered() -> list[str]:
    """The names of the waiters, in the order they got their place."""
    return []


async def settle() -> None:
    """Lets every task that can run, run (a bounded number of loop turns)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def finished(*tasks: asyncio.Task[None]) -> None:
    """Waits a bounded number of loop turns for the tasks to end, and raises what they raised: a
    waiter that never gets its place fails the test instead of hanging it."""
    for _ in range(200):
        if all(task.done() for task in tasks):
            break
        await asyncio.sleep(0)
    assert all(task.done() for task in tasks), "a waiter never got its place"
    for task in tasks:
        task.result()


def waiter(gate: Gate, order: list[str], name: str, limit: int = 1, queue: int = 10) -> asyncio.Task[None]:
    async def enter() -> None:
        await gate.enter("alice", limit, LONG, queue)
        order.append(name)

    return asyncio.ensure_future(enter())


@pytest.mark.anyio
async def test_places_under_the_limit_are_taken_at_once() -> None:
    gate = Gate()
    for _ in range(3):
        await gate.enter("alice", 3, LONG, 10)
    assert (gate.in_flight, gate.waiting) == (3, 0)


@pytest.mark.anyio
async def test_a_request_over_the_limit_waits_until_one_leaves() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 1, LONG, 10)
    task = waiter(gate, order, "second")
    await settle()
    assert order == [] and gate.waiting == 1 and not task.done()
    gate.leave()
    await finished(task)
    assert order == ["second"] and (gate.in_flight, gate.waiting) == (1, 0)


@pytest.mark.anyio
async def test_freed_places_go_to_waiters_in_arrival_order() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 1, LONG, 10)
    tasks = [waiter(gate, order, name) for name in ("a", "b", "c")]
    await settle()
    for _ in tasks:
        gate.leave()
        await settle()
    await finished(*tasks)
    assert order == ["a", "b", "c"]


@pytest.mark.anyio
async def test_a_newcomer_never_overtakes_a_waiter_handed_a_place() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 1, LONG, 10)
    first = waiter(gate, order, "waited")
    await settle()
    gate.leave()  # handed to the waiter, which has not run yet
    late = waiter(gate, order, "newcomer")
    await settle()
    assert order == ["waited"] and not late.done()
    gate.leave()
    await finished(first, late)
    assert order == ["waited", "newcomer"]


@pytest.mark.anyio
async def test_a_newcomer_waits_behind_others_even_when_a_place_is_free() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 2, LONG, 10)
    await gate.enter("alice", 2, LONG, 10)
    queued = waiter(gate, order, "queued", limit=2)
    await settle()
    # A wider limit (after a reload, say) frees a place, but someone already waits for one.
    newcomer = waiter(gate, order, "newcomer", limit=3)
    await settle()
    assert order == [] and gate.waiting == 2
    gate.leave()
    gate.leave()
    await finished(queued, newcomer)
    assert order == ["queued", "newcomer"]


@pytest.mark.anyio
async def test_leaving_with_nobody_waiting_frees_the_place() -> None:
    gate = Gate()
    await gate.enter("alice", 2, LONG, 10)
    await gate.enter("alice", 2, LONG, 10)
    gate.leave()
    assert gate.in_flight == 1
    gate.leave()
    assert gate.in_flight == 0


@pytest.mark.anyio
async def test_a_full_queue_refuses_at_once_naming_the_key_and_its_limit() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 1, LONG, 2)
    tasks = [waiter(gate, order, name, queue=2) for name in ("a", "b")]
    await settle()
    with pytest.raises(QueueFull) as raised:
        await gate.enter("alice", 1, LONG, 2)
    error = raised.value
    assert (error.status, error.code, error.headers) == (429, "key_queue_full", {"retry-after": "1"})
    assert "Key 'alice'" in error.message and "concurrent=1" in error.message
    assert gate.waiting == 2
    for _ in tasks:
        gate.leave()
    await finished(*tasks)


@pytest.mark.anyio
async def test_a_queue_of_zero_still_lets_one_request_wait() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 1, LONG, 0)
    task = waiter(gate, order, "one", queue=0)
    await settle()
    assert gate.waiting == 1
    with pytest.raises(QueueFull):
        await gate.enter("alice", 1, LONG, 0)
    gate.leave()
    await finished(task)
    assert order == ["one"]


@pytest.mark.anyio
async def test_a_wait_past_the_timeout_is_a_queue_timeout_and_leaves_the_line() -> None:
    gate = Gate()
    await gate.enter("alice", 1, LONG, 10)
    with pytest.raises(QueueTimeout) as raised:
        await gate.enter("alice", 1, 0.0, 10)
    assert (raised.value.status, raised.value.code) == (504, "key_concurrency_timeout")
    assert (gate.in_flight, gate.waiting) == (1, 0)
    gate.leave()
    assert gate.in_flight == 0  # the timed-out request was not handed the place


@pytest.mark.anyio
async def test_a_waiter_cancelled_before_its_turn_takes_no_place() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 1, LONG, 10)
    task = waiter(gate, order, "gone")
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (gate.in_flight, gate.waiting) == (1, 0)
    gate.leave()
    assert gate.in_flight == 0


@pytest.mark.anyio
async def test_a_place_freed_as_a_waiter_is_cancelled_goes_to_the_next_waiter() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 1, LONG, 10)
    gone, next_ = waiter(gate, order, "gone"), waiter(gate, order, "next")
    await settle()
    gone.cancel()  # its wait is cancelled at once; it leaves the line when it next runs
    gate.leave()
    await finished(next_)
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert order == ["next"] and (gate.in_flight, gate.waiting) == (1, 0)


@pytest.mark.anyio
async def test_a_waiter_cancelled_after_it_was_handed_a_place_gives_it_back() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 1, LONG, 10)
    handed = waiter(gate, order, "handed")
    await settle()
    gate.leave()  # the place is now the waiter's, but it has not run
    handed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handed
    assert order == [] and (gate.in_flight, gate.waiting) == (0, 0)
    await gate.enter("alice", 1, LONG, 10)  # the place is free again
    assert gate.in_flight == 1


@pytest.mark.anyio
async def test_a_place_given_back_by_a_cancelled_waiter_passes_to_the_next_in_line() -> None:
    gate, order = Gate(), entered()
    await gate.enter("alice", 1, LONG, 10)
    handed, behind = waiter(gate, order, "handed"), waiter(gate, order, "behind")
    await settle()
    gate.leave()
    handed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handed
    await finished(behind)
    assert order == ["behind"] and (gate.in_flight, gate.waiting) == (1, 0)
