"""The client's presence: what notices when a request's client leaves.

When the client disconnects, in any phase, the request's task is cancelled, and cancellation
closes the upstream connection: vLLM aborts the request, llama-server frees the slot, and no GPU
time goes to an answer nobody reads. A cancellation that did not come from here (the server
stopping) is told apart by `client_left`.

Under the gateway's own server the connection says so itself (`ClientLink`, set up by
edge/connection.py): its `connection_lost` calls the request back, and no task waits per request.
Under any other ASGI server a watcher task waits on `receive()` for `http.disconnect`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gateway.types import Receive


class Presence:
    """Shared by a request and its watcher."""

    __slots__ = ("client_left", "serving")

    def __init__(self) -> None:
        self.serving = True
        self.client_left = False


class ClientLink:
    """What a connection tells the request it carries (`scope["gateway.link"]`): whether the
    request's body has arrived whole, and a call for when the client goes away. A connection holds
    the link of its latest request only (as uvicorn tells only its latest request of a
    disconnect)."""

    __slots__ = ("body_complete", "on_lost")

    def __init__(self) -> None:
        self.body_complete = False
        self.on_lost: Callable[[], None] | None = None

    def lost(self) -> None:
        """The connection closed: tell the request, once."""
        callback, self.on_lost = self.on_lost, None
        if callback is not None:
            callback()


class Watching:
    """Watch for the client leaving while the body of the `with` runs in the current task (a class,
    not a generator: it is entered on every request)."""

    __slots__ = ("link", "presence", "receive", "task", "watcher")

    def __init__(self, receive: Receive, link: ClientLink | None = None) -> None:
        self.receive, self.link = receive, link
        self.presence = Presence()
        self.watcher: asyncio.Task[None] | None = None

    def __enter__(self) -> Presence:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        if self.link is not None:
            self.link.on_lost = self._left
        else:
            self.watcher = asyncio.get_running_loop().create_task(_watch(self.receive, task, self.presence))
        return self.presence

    def __exit__(self, *exc: object) -> None:
        self.presence.serving = False
        if self.link is not None:
            self.link.on_lost = None
        if self.watcher is not None:
            self.watcher.cancel()

    def _left(self) -> None:
        if self.presence.serving:
            self.presence.client_left = True
            self.task.cancel()


async def _watch(receive: Receive, task: asyncio.Task[Any], presence: Presence) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if presence.serving:
        presence.client_left = True
        task.cancel()
