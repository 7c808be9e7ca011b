"""The client connection's cork (gateway/edge/corked.py): what is written within one turn of the
event loop reaches the socket as one write, in order, and nothing is held past the turn, a close or
its size bound."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.edge.corked import FLUSH_AT, CorkedTransport
from tests.support.harness import one_replica_table, run_gateway
from tests.support.servers import sim_replica


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


def data_segments_in(sock: socket.socket) -> int | None:
    """Segments with data this socket has received (Linux's tcp_info `tcpi_data_segs_in`), or None
    where the kernel does not report it."""
    info = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO", 11), 256)
    return int.from_bytes(info[152:156], "little") if len(info) >= 160 else None


def read_answer(sock: socket.socket) -> bytes:
    """One answer with a content-length, read whole."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < length_of(data):
        piece = sock.recv(65536)
        assert piece, data
        data += piece
    return data


def length_of(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    return int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="tcp_info is Linux's")
def test_the_gateway_sends_a_whole_answer_in_one_write_and_pipelined_answers_in_order() -> None:
    """Through uvicorn and the gateway's protocol on a real socket: the head and body of an answer
    reach the client as one segment (one write), and pipelined requests are answered in order."""
    replica = sim_replica("vllm", "m")
    try:
        with run_gateway(one_replica_table(replica.url)) as gw:
            host, port = gw.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                before = data_segments_in(sock)
                if before is None:
                    pytest.skip("this kernel does not report data segments")
                sock.sendall(HEALTH)
                answer = read_answer(sock)
                assert answer.startswith(b"HTTP/1.1 200") and data_segments_in(sock) == before + 1
                sock.sendall(b"".join(HEALTH.replace(b"/health", path) for path in PATHS))
                answers = [read_answer(sock) for _ in PATHS]
                assert [a.split(b" ", 2)[1] for a in answers] == [b"200", b"404", b"200"], answers
                assert b'"data"' in answers[2]  # /v1/models, last, as asked
    finally:
        replica.stop()


HEALTH = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
PATHS = (b"/health", b"/nowhere", b"/v1/models")
