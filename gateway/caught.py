"""An exception caught in a `try`, acted on after the block.

The compiled request path never awaits inside an `except` or `finally` block (mypyc loses the
coroutine's exception state there; gateway/DESIGN.md, "The compiled build"). So a block that must
await a cleanup, or await on the failure's behalf, keeps the exception in a `Caught`, leaves the
block, awaits, and then takes the exception or raises it again (`raise_again`).

Why an object and not a local variable: an exception's traceback holds the frame that caught it,
and a local holding the exception closes the circle, so the frame and all it holds (a request's
body, a replica's answer) would wait for the cycle collector. Taking the exception out of its
holder, or raising it again, lets go of it at once, as `except ... as error` does when its block
ends. The holder is made only when something was caught: the common path pays for none.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

E = TypeVar("E", bound=BaseException)


class Caught(Generic[E]):
    __slots__ = ("error",)

    def __init__(self, error: E) -> None:
        self.error: E | None = error

    def take(self) -> E:
        """The exception caught, let go of (once)."""
        error, self.error = self.error, None
        assert error is not None
        return error


def raise_again(caught: Caught[Any] | None) -> None:
    """Raise the exception caught, if any, let go of; nothing if none was."""
    if caught is None or caught.error is None:
        return
    error, caught.error = caught.error, None
    try:
        raise error
    finally:
        error = None  # this frame is in the traceback too
