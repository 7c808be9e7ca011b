"""The client's presence: a request is cancelled when its client leaves, told by the connection
itself (a ClientLink) or, under another server, by a watcher on receive()."""

import asyncio
from typing import Any

import pytest

from gateway.pipeline.disconnect import ClientLink, Watching

pytestmark = pytest.mark.anyio


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


async def test_a_lost_connection_cancels_the_request_and_says_the_client_left() -> None:
    link = ClientLink()
    seen: dict[str, Any] = {}

    async def request() -> None:
        with Watching(_never, link) as presence:
            seen["presence"] = presence
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                seen["cancelled"] = True
                raise

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    assert link.on_lost is not None
    link.lost()
    await asyncio.gather(task, return_exceptions=True)
    assert seen["cancelled"] and seen["presence"].client_left
    assert link.on_lost is None


async def test_a_connection_lost_after_the_request_ended_cancels_nothing() -> None:
    link = ClientLink()
    with Watching(_never, link) as presence:
        pass
    assert link.on_lost is None
    link.lost()  # the connection closes later: nothing to tell
    assert not presence.client_left


async def test_without_a_link_a_watcher_reads_the_disconnect_from_receive() -> None:
    left = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await left.wait()
        return {"type": "http.disconnect"}

    seen: dict[str, Any] = {}

    async def request() -> None:
        with Watching(receive) as presence:
            seen["presence"] = presence
            await asyncio.Event().wait()

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    left.set()
    results = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert seen["presence"].client_left
