"""The client's presence: a watcher beside each request that notices when its client leaves.

When the client disconnects, in any phase, the watcher cancels the request's task, and
cancellation closes the upstream connection: vLLM aborts the request, llama-server frees the slot,
and no GPU time goes to an answer nobody reads. A cancellation that did not come from the watcher
(the server stopping) is told apart by `client_left`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.types import Receive


class Presence:
    """Shared by a request and its watcher."""

    __slots__ = ("client_left", "serving")

    def __init__(self) -> None:
        self.serving = True
        self.client_left = False


@contextmanager
def watching(receive: Receive) -> Iterator[Presence]:
    """Watch for the client leaving while the body of the `with` runs in the current task."""
    task = asyncio.current_task()
    assert task is not None
    presence = Presence()
    watcher = asyncio.get_running_loop().create_task(_watch(receive, task, presence))
    try:
        yield presence
    finally:
        presence.serving = False
        watcher.cancel()


async def _watch(receive: Receive, task: asyncio.Task[Any], presence: Presence) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if presence.serving:
        presence.client_left = True
        task.cancel()
