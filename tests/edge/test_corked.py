"""The client connection's cork (gateway/edge/corked.py): what is written within one turn of the
event loop reaches the socket as one write, in order, and nothing is held past the turn, a close or
its size bound. tests/e2e/test_edge_connection.py checks the same on a real socket."""

from __future__ import annotations

import asyncio

import pytest

from gateway.edge.corked import FLUSH_AT, CorkedTransport


class Recording:
    """The transport under the cork: the writes it was handed, and whether it was closed."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        self.paused = True


def cork() -> tuple[CorkedTransport, Recording]:
    under = Recording()
    return CorkedTransport(under, asyncio.get_running_loop()), under  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_writes_within_one_turn_leave_as_one_write_at_the_end_of_the_turn() -> None:
    corked, under = cork()
    corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
    corked.write(b"body")
    assert under.writes == [] and corked.get_write_buffer_size() == 23
    await asyncio.sleep(0)
    assert under.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    corked.write(b"next turn")
    await asyncio.sleep(0)
    assert under.writes[-1] == b"next turn" and len(under.writes) == 2


@pytest.mark.anyio
async def test_flush_and_close_send_what_is_held_first_and_abort_drops_it() -> None:
    corked, under = cork()
    corked.write(b"a")
    corked.flush()
    corked.write(b"b")
    corked.close()
    assert under.writes == [b"a", b"b"] and under.closed
    await asyncio.sleep(0)  # the turn's own flush finds nothing left, and a closed socket gets nothing
    assert under.writes == [b"a", b"b"]
    corked, under = cork()
    corked.write(b"never sent")
    corked.abort()
    await asyncio.sleep(0)
    assert under.writes == [] and under.aborted


@pytest.mark.anyio
async def test_a_large_write_goes_through_at_once_after_what_was_held_and_is_not_copied() -> None:
    corked, under = cork()
    big = memoryview(bytearray(FLUSH_AT))
    corked.write(b"head")
    corked.write(big)
    assert under.writes[0] == b"head" and len(under.writes) == 2 and under.writes[1] == bytes(big)
    for _ in range(FLUSH_AT // 1024):  # small writes held up to the bound, not beyond
        corked.write(b"x" * 1024)
    assert corked.get_write_buffer_size() == 0 and under.writes[-1] == b"x" * FLUSH_AT


@pytest.mark.anyio
async def test_other_transport_methods_are_the_wrapped_ones() -> None:
    corked, under = cork()
    corked.pause_reading()
    assert under.paused and not corked.is_closing()
