"""The request's deadline behaves as asyncio.timeout_at does: each case runs with both (ours also
given the loop, as the request path enters it)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from gateway.pipeline.deadline import Deadline


@contextlib.asynccontextmanager
async def ours(when: float) -> Any:
    with Deadline(when):
        yield


@contextlib.asynccontextmanager
async def ours_given_the_loop(when: float) -> Any:
    with Deadline(when, asyncio.get_running_loop()):
        yield


KINDS: list[Callable[[float], Any]] = [ours, ours_given_the_loop, asyncio.timeout_at]


def later(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def ending_of(task: asyncio.Future[None]) -> str:
    """How a task running a deadline's block ended."""
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    except TimeoutError:
        return "timed out"
    return "finished"


@pytest.mark.parametrize("deadline", KINDS)
def test_a_block_past_its_deadline_ends_in_timeout_error(deadline: Callable[[float], Any]) -> None:
    async def run() -> str:
        try:
            async with deadline(later(0.01)):
                await asyncio.sleep(30)
        except TimeoutError:
            return "timed out"
        return "finished"

    assert asyncio.run(run()) == "timed out"


@pytest.mark.parametrize("deadline", KINDS)
def test_a_block_that_ends_in_time_is_left_alone(deadline: Callable[[float], Any]) -> None:
    async def run() -> tuple[str, int]:
        async with deadline(later(30)):
            await asyncio.sleep(0)
        await asyncio.sleep(0.02)  # nothing fires later either
        task = asyncio.current_task()
        assert task is not None
        return "finished", task.cancelling()

    assert asyncio.run(run()) == ("finished", 0)


@pytest.mark.parametrize("deadline", KINDS)
def test_a_deadline_already_past_still_lets_the_block_start(deadline: Callable[[float], Any]) -> None:
    async def run() -> list[str]:
        seen = []
        try:
            async with deadline(later(-1)):
                seen.append("entered")
                await asyncio.sleep(30)
        except TimeoutError:
            seen.append("timed out")
        return seen

    assert asyncio.run(run()) == ["entered", "timed out"]


@pytest.mark.parametrize("deadline", KINDS)
def test_a_cancel_from_outside_stays_a_cancel(deadline: Callable[[float], Any]) -> None:
    """A client that leaves cancels the request's task: that must not read as the deadline."""

    async def body(started: asyncio.Event) -> None:
        async with deadline(later(30)):
            started.set()
            await asyncio.sleep(30)

    async def run() -> str:
        started = asyncio.Event()
        task = asyncio.ensure_future(body(started))
        await started.wait()
        task.cancel()
        return await ending_of(task)

    assert asyncio.run(run()) == "cancelled"


@pytest.mark.parametrize("deadline", KINDS)
def test_a_cancel_from_outside_after_the_deadline_fired_stays_a_cancel(
    deadline: Callable[[float], Any],
) -> None:
    async def body() -> None:
        async with deadline(later(-1)):
            task = asyncio.current_task()
            assert task is not None
            try:
                await asyncio.sleep(30)  # the deadline's cancel arrives here
            except asyncio.CancelledError:
                task.cancel()  # and a second one, as a leaving client's would, before the block ends
                await asyncio.sleep(0)

    async def run() -> str:
        return await ending_of(asyncio.ensure_future(body()))

    assert asyncio.run(run()) == "cancelled"


@pytest.mark.parametrize("deadline", KINDS)
def test_an_inner_deadline_times_out_its_own_block_only(deadline: Callable[[float], Any]) -> None:
    async def run() -> list[str]:
        seen = []
        async with deadline(later(30)):
            try:
                async with deadline(later(0.01)):
                    await asyncio.sleep(30)
            except TimeoutError:
                seen.append("inner timed out")
            await asyncio.sleep(0)
            seen.append("outer went on")
        return seen

    assert asyncio.run(run()) == ["inner timed out", "outer went on"]


def test_a_deadline_outside_a_task_is_refused() -> None:
    """A loop callback runs in no task: there is nothing the deadline could cancel."""

    async def run() -> str:
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        def callback() -> None:
            try:
                Deadline(later(30)).__enter__()
            except RuntimeError as error:
                done.set_result(str(error))
            else:
                done.set_result("entered")

        asyncio.get_running_loop().call_soon(callback)
        return await done

    assert asyncio.run(run()) == "a deadline needs a task to cancel"
