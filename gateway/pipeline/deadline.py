"""A deadline for the current task: `asyncio.timeout_at`'s behaviour, at about two thirds of its cost.

Every request runs its whole answer under one deadline (pipeline/proxy.py). `asyncio.timeout_at`
is an asynchronous context manager: entering and leaving it make two coroutines, and it keeps an
enum state and a reschedulable handle the request never uses: 5-6 us a use on uvloop against
3.6-3.8 for this one, and 2 % of a small request's instructions (callgrind, in process). This one
is entered with a plain `with` and keeps the same rule for telling its own cancellation from any
other: the task is cancelled when the time comes, and on the way out that cancellation becomes
`TimeoutError` only when no other cancellation arrived meanwhile (the task's `cancelling()` count,
as `asyncio.Timeout` reads it).
"""

from __future__ import annotations

import asyncio


class Deadline:
    """`with Deadline(when):` inside a task: TimeoutError out of the block once the loop's clock
    passes `when` (a `loop.time()` value)."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_loop", "_task", "when")

    def __init__(self, when: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """`loop`: the running loop, where the caller has it already (each call of
        `asyncio.get_running_loop` makes a getpid system call on Python 3.11)."""
        self.when = when
        self._loop = loop
        self._expired = False

    def __enter__(self) -> Deadline:
        loop = self._loop or asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a deadline needs a task to cancel")
        self._task, self._cancelling = task, task.cancelling()
        if self.when <= loop.time():
            self._handle: asyncio.Handle = loop.call_soon(self._expire)
        else:
            self._handle = loop.call_at(self.when, self._expire)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        self._handle.cancel()
        if self._expired and self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
            raise TimeoutError from error

    def _expire(self) -> None:
        self._task.cancel()
        self._expired = True
