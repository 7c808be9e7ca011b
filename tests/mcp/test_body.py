"""gateway/mcp/body.py: an MCP body is read whole within its size and its deadline, and the SDK
then reads the same bytes, then the connection's own messages."""

from __future__ import annotations

import asyncio

import pytest

from gateway.mcp.body import BodyRefused, ClientLeft, content_length, read_body, replay
from gateway.types import Message, Receive


def pieces(*chunks: bytes) -> Receive:
    queue = list(chunks)

    async def receive() -> Message:
        chunk = queue.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(queue)}

    return receive


@pytest.mark.anyio
async def test_a_body_in_pieces_is_read_whole() -> None:
    assert await read_body(pieces(b'{"a"', b": 1", b"}"), None, 1024, 5) == b'{"a": 1}'


@pytest.mark.anyio
async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    async def never() -> Message:
        raise AssertionError("the body was read")

    with pytest.raises(BodyRefused) as refused:
        await read_body(never, 5_000_000, 4_194_304, 5)
    assert refused.value.status == 413 and "4194304" in refused.value.message


@pytest.mark.anyio
async def test_a_body_that_grows_past_the_limit_is_refused_as_it_arrives() -> None:
    with pytest.raises(BodyRefused) as refused:
        await read_body(pieces(b"x" * 600, b"x" * 600, b"x" * 600), None, 1024, 5)
    assert refused.value.status == 413


@pytest.mark.anyio
async def test_a_body_that_stops_arriving_is_refused_at_the_deadline() -> None:
    stalled = asyncio.Event()

    async def trickle() -> Message:
        if not stalled.is_set():
            stalled.set()
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.Event().wait()  # the rest never comes
        raise AssertionError("unreachable")

    with pytest.raises(BodyRefused) as refused:
        await read_body(trickle, None, 1024, 0.05)
    assert refused.value.status == 408 and stalled.is_set()


@pytest.mark.anyio
async def test_a_client_that_leaves_while_sending_is_noticed() -> None:
    async def gone() -> Message:
        return {"type": "http.disconnect"}

    with pytest.raises(ClientLeft):
        await read_body(gone, None, 1024, 5)


@pytest.mark.anyio
async def test_the_replay_gives_the_body_once_then_the_connection() -> None:
    async def connection() -> Message:
        return {"type": "http.disconnect"}

    receive = replay(b"{}", connection)
    assert await receive() == {"type": "http.request", "body": b"{}", "more_body": False}
    assert await receive() == {"type": "http.disconnect"}


@pytest.mark.parametrize(
    ("value", "length"), [(b"12", 12), (b" 7 ", 7), (b"\xc2\xb2", None), (b"-1", None), (b"9" * 30, None)]
)
def test_content_length_is_read_only_when_it_is_plain_digits(value: bytes, length: int | None) -> None:
    assert content_length([(b"content-length", value)]) == length
