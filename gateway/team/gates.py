"""Per-key concurrency: a key over its `concurrent` limit waits until one of its requests ends.

One gate per named key with a limit, in this process. A place that frees is handed to the oldest
waiter (as the pools do), so a newcomer never overtakes a request that waited for it.
"""

from __future__ import annotations

import asyncio
from collections import deque

from gateway.errors import QueueFull, QueueTimeout


class Gate:
    """One named key's concurrency gate in this process: `enter` takes a place or waits for one in
    arrival order, `leave` hands the freed place to the oldest waiter. The team keeps one per key
    with a `concurrent` limit, held for a request until its answer ends."""

    def __init__(self) -> None:
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def enter(self, name: str, limit: int, timeout: float, queue: int) -> None:
        """Takes one of `limit` places for key `name`, waiting in line when none is free or others
        wait first. Raises `QueueFull` when `queue` requests already wait and `QueueTimeout` after
        `timeout` seconds; a waiter cancelled after it was handed a place gives it back."""
        if self.in_flight < limit and not self._waiters:
            self.in_flight += 1
            return
        if len(self._waiters) >= max(1, queue):
            raise QueueFull(
                f"Key '{name}' has {self.in_flight} requests running (concurrent={limit}) and its queue "
                "is full; retry shortly",
                code="key_queue_full",
                headers={"retry-after": "1"},
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await waiter
        except TimeoutError:
            raise QueueTimeout(
                f"Key '{name}' had {limit} requests running (concurrent={limit}) for the whole queue "
                f"timeout of {timeout:g} s",
                code="key_concurrency_timeout",
            ) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.leave()  # handed the place, then cancelled before it ran: it goes on
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def leave(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the place passes on: in_flight stays
                return
        self.in_flight -= 1
