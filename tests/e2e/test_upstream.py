"""The upstream client contract (gateway/upstream/__init__.py), the same for every client kind.

Against real sockets on 127.0.0.1: the scripted upstream of tests/support/faults.py (FU) in a thread, or a
raw socket server for answers FU does not give. Each test runs its client on uvloop, as the gateway
does in production (the reliability catalogue runs the gateway on asyncio's own loop). Timing is
only ever compared with what the server recorded on the same monotonic clock, never with a bound a
busy machine could miss; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import uvloop

from gateway.upstream import (
    PROBE_BODY_LIMIT,
    BodyFailed,
    ConnectFailed,
    HeaderTimeout,
    IdleTimeout,
    ProtocolFailure,
    Reset,
    Timeouts,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
    create_client,
)
from tests.support.fault_behaviours import (
    Behaviour,
    CloseBeforeHeaders,
    Flood,
    Hang,
    HugeBody,
    Reply,
    ResetBeforeHeaders,
    Sse,
)
from tests.support.fault_connection import Conn
from tests.support.fault_records import Request, now
from tests.support.faults import fault_server
from tests.support.rawhttp import free_port

KINDS = ("aiohttp", "httpx2", "lean")
CHAT = "/v1/chat/completions"
JSON = [("content-type", "application/json")]
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
RELAXED = Timeouts(connect=2.0, first_byte=10.0, idle=10.0)
TEST_BOUND = 20.0  # no test may hang: each one's coroutine is cut off after this

pytestmark = pytest.mark.parametrize("kind", KINDS)


def run(kind: str, test: Callable[[UpstreamClient], Awaitable[Any]], **options: Any) -> Any:
    async def main() -> Any:
        client = create_client(kind, **options)
        try:
            async with asyncio.timeout(TEST_BOUND):
                return await test(client)
        finally:
            await client.aclose()

    return uvloop.run(main())


async def exchange(client: UpstreamClient, url: str, timeouts: Timeouts = RELAXED, **kw: Any) -> bytes:
    """One POST, its body read whole and the response closed."""
    response = await client.send(url + CHAT, kw.get("headers", JSON), BODY, timeouts)
    try:
        return await response.read()
    finally:
        await response.close()


def known_gap(request: pytest.FixtureRequest, reason: str) -> None:
    """A client that misses this part of the contract: the test still runs, and must fail."""
    request.applymarker(pytest.mark.xfail(reason=reason, strict=True))


async def collect(response: UpstreamResponse, into: list[bytes]) -> None:
    async for piece in response.chunks():
        into.append(piece)


async def settle() -> None:
    """A moment for FINs and RSTs already on the wire to reach the client's event loop."""
    await asyncio.sleep(0.05)


@dataclass(frozen=True)
class Raw(Behaviour):
    """Write `data` as it is, then keep the connection open until the client leaves."""

    data: bytes

    async def run(self, conn: Conn, req: Request) -> bool:
        conn.write(req, self.data)
        await conn.wait_lost()
        return False


class Canned:
    """A raw server answering every request head with `answer`: for GETs (FU answers those itself) and
    for tests that must know every byte a client sent, even on a connection opened just before the end
    (FU may not have registered such a connection yet when it stops)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.received: list[bytes] = []  # every byte read, per connection
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            sock.settimeout(10)
            self.sockets.append(sock)
            self.received.append(b"")
            thread = threading.Thread(target=self._answer, args=(sock, len(self.received) - 1), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _answer(self, sock: socket.socket, index: int) -> None:
        with contextlib.suppress(OSError), sock:
            while b"\r\n\r\n" not in self.received[index]:
                piece = sock.recv(65536)
                if not piece:
                    return
                self.received[index] += piece
            sock.sendall(self.answer)
            while piece := sock.recv(65536):
                self.received[index] += piece

    def finish(self) -> None:
        """Stop accepting, and wait (bounded) until every connection's bytes have been read."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.acceptor.join(5)
        for thread in self.threads:
            thread.join(5)

    def close(self) -> None:
        self.finish()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def canned(answer: bytes) -> Iterator[Canned]:
    server = Canned(answer)
    try:
        yield server
    finally:
        server.close()


# --- answers ------------------------------------------------------------------------------------------


def test_json_answer(kind: str) -> None:
    answer = {"id": "x", "choices": []}
    with fault_server(Reply(body=answer, headers=(("X-Custom", "v1"), ("Retry-After", "3")))) as fu:

        async def test(client: UpstreamClient) -> None:
            response = await client.send(fu.url + CHAT, JSON, BODY, RELAXED)
            try:
                assert response.status == 200
                assert response.headers.get("content-type") == "application/json"
                assert response.headers.get("Content-Type") == "application/json"
                assert response.headers.get("x-custom") == "v1"
                assert response.headers.get("retry-after") == "3"
                assert response.headers.get("x-absent") is None
                assert await response.read() == b'{"id": "x", "choices": []}'
            finally:
                await response.close()

        run(kind, test)
        request = fu.chat_requests[0]
        assert request.body == BODY
        assert request.header("content-type") == "application/json"
        assert request.header("content-length") == str(len(BODY))
        assert request.header("host") == fu.url.removeprefix("http://")


def test_sse_stream_arrives_in_pieces_as_written(kind: str) -> None:
    with fault_server(Sse(events=2, delay=1.0)) as fu:

        async def test(client: UpstreamClient) -> tuple[float, bytes, bytes]:
            response = await client.send(fu.url + CHAT, JSON, BODY, RELAXED)
            try:
                assert response.headers.get("content-type") == "text/event-stream"
                pieces = response.chunks()
                first = await anext(pieces)
                at = now()
                rest = b"".join([piece async for piece in pieces])
                return at, first, rest
            finally:
                await response.close()

        first_at, first, rest = run(kind, test)
        # The first event reached the caller before the server had even written the second one.
        assert first_at < fu.chat_requests[0].events_sent[1]
        assert b"fu:0 " in first and b"fu:1 " not in first
        assert b"fu:1 " in rest and rest.endswith(b"data: [DONE]\n\n")


def test_a_large_event_arrives_whole_in_bounded_pieces(kind: str) -> None:
    with fault_server(Sse(events=2, big_event=1024 * 1024)) as fu:

        async def test(client: UpstreamClient) -> list[bytes]:
            response = await client.send(fu.url + CHAT, JSON, BODY, RELAXED)
            pieces: list[bytes] = []
            try:
                await collect(response, pieces)
            finally:
                await response.close()
            return pieces

        pieces = run(kind, test)
        # A slow client must not make the gateway hold a replica's burst in one piece.
        assert max(len(piece) for piece in pieces) <= 64 * 1024
        body = b"".join(pieces)
        assert b"x" * (1024 * 1024) in body and body.endswith(b"data: [DONE]\n\n")


def test_body_delimited_by_the_connection_end(kind: str) -> None:
    with fault_server(Sse(events=2, framing="close")) as fu:

        async def test(client: UpstreamClient) -> bytes:
            return await exchange(client, fu.url)

        assert run(kind, test).endswith(b"data: [DONE]\n\n")


def test_informational_response_is_skipped(kind: str) -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    with fault_server(Raw(answer)) as fu:

        async def test(client: UpstreamClient) -> tuple[int, bytes]:
            response = await client.send(fu.url + CHAT, JSON, BODY, RELAXED)
            try:
                return response.status, await response.read()
            finally:
                await response.close()

        assert run(kind, test) == (200, b"ok")


def test_redirect_is_returned_not_followed(kind: str) -> None:
    with fault_server(Reply(302, body=b"", headers=(("location", "/v1/completions"),))) as fu:

        async def test(client: UpstreamClient) -> int:
            response = await client.send(fu.url + CHAT, JSON, BODY, RELAXED)
            await response.read()
            await response.close()
            return response.status

        assert run(kind, test) == 302
        assert [request.path for request in fu.requests] == [CHAT]


# --- connection reuse ---------------------------------------------------------------------------------


def test_sequential_requests_share_one_connection(kind: str) -> None:
    with fault_server() as fu:

        async def test(client: UpstreamClient) -> None:
            await exchange(client, fu.url)
            await exchange(client, fu.url)

        run(kind, test)
        assert len(fu.connections) == 1
        assert [request.index for request in fu.chat_requests] == [0, 1]


def test_no_reuse_after_the_server_says_close(kind: str) -> None:
    with fault_server(Reply(close=True)) as fu:

        async def test(client: UpstreamClient) -> None:
            await exchange(client, fu.url)
            await exchange(client, fu.url)

        run(kind, test)
        assert [request.index for request in fu.chat_requests] == [0, 0]


def test_no_reuse_after_the_request_says_close(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "aiohttp":
        # aiohttp decides reuse from the response alone (and releases a small body's connection
        # before the caller sees it); the gateway's llama.cpp streams rely on this, so lean is the default.
        known_gap(request, "aiohttp pools a connection whose request said close when the response did not")
    # FU itself ignores the request's `connection: close` and would serve a second request.
    with fault_server() as fu:

        async def test(client: UpstreamClient) -> None:
            await exchange(client, fu.url, headers=[*JSON, ("connection", "close")])
            await exchange(client, fu.url)

        run(kind, test)
        assert [request.index for request in fu.chat_requests] == [0, 0]
        assert fu.wait_for(lambda: fu.connections[0].closed)


def test_no_reuse_after_the_keepalive_expiry(kind: str) -> None:
    with fault_server() as fu:

        async def test(client: UpstreamClient) -> None:
            await exchange(client, fu.url)
            await asyncio.sleep(0.6)  # past the client's expiry of 0.3 s; FU never closes idle ones
            await exchange(client, fu.url)

        run(kind, test, keepalive_expiry=0.3)
        assert [request.index for request in fu.chat_requests] == [0, 0]


def test_connection_the_server_closed_while_idle_is_not_reused(kind: str) -> None:
    with fault_server(idle_close=0.1) as fu:

        async def test(client: UpstreamClient) -> None:
            await exchange(client, fu.url)
            assert await asyncio.to_thread(fu.wait_for, lambda: fu.connections[0].closed)
            await settle()
            await exchange(client, fu.url)

        run(kind, test)
        assert [request.index for request in fu.chat_requests] == [0, 0]


def test_keepalive_race_surfaces_as_reset(kind: str) -> None:
    """The replica closes an idle connection just as it is reused: the request meets a FIN (or an
    RST) before any response header, which is a Reset, the failure the gateway retries."""

    def route(request: Request) -> Behaviour:
        return CloseBeforeHeaders() if request.index > 0 else Reply()

    with fault_server(route=route) as fu:

        async def test(client: UpstreamClient) -> None:
            await exchange(client, fu.url)
            with pytest.raises(Reset):
                await exchange(client, fu.url)

        run(kind, test)
        assert [request.index for request in fu.chat_requests] == [0, 1]


# --- failures before the headers ----------------------------------------------------------------------


def test_refused_connection(kind: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def test(client: UpstreamClient) -> None:
        with pytest.raises(ConnectFailed):
            await exchange(client, url)

    run(kind, test)


def test_unresolvable_host(kind: str) -> None:
    async def test(client: UpstreamClient) -> None:
        with pytest.raises(ConnectFailed):
            await exchange(client, "http://no-such-replica.invalid:8000")

    run(kind, test)


@pytest.mark.parametrize("behaviour", [CloseBeforeHeaders(), ResetBeforeHeaders()], ids=["close", "reset"])
def test_closed_before_headers_is_reset(kind: str, behaviour: Behaviour) -> None:
    with fault_server(behaviour) as fu:

        async def test(client: UpstreamClient) -> None:
            with pytest.raises(Reset):
                await exchange(client, fu.url)

        run(kind, test)
        assert len(fu.chat_requests) == 1


def test_hang_before_headers_is_a_header_timeout(kind: str) -> None:
    with fault_server(Hang()) as fu:

        async def test(client: UpstreamClient) -> None:
            with pytest.raises(HeaderTimeout):
                await exchange(client, fu.url, Timeouts(connect=2.0, first_byte=0.3, idle=10.0))

        run(kind, test)
        # Giving up closed the connection: the replica learns that nobody waits for the answer.
        assert fu.wait_for(lambda: fu.connections[0].closed)


def test_cancelled_before_headers_closes_the_connection(kind: str) -> None:
    with fault_server(Hang()) as fu:

        async def test(client: UpstreamClient) -> None:
            waiting = asyncio.ensure_future(exchange(client, fu.url))
            assert await asyncio.to_thread(fu.wait_for, lambda: bool(fu.chat_requests))
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting

        run(kind, test)
        assert fu.wait_for(lambda: fu.connections[0].eof.is_set())


def test_garbage_is_a_protocol_failure(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "httpx2":
        # h11's RemoteProtocolError is also what a closed connection raises: the client calls it Reset.
        known_gap(request, "httpx2 reports an unparsable status line as Reset")
    with fault_server(Raw(b"SSH-2.0-OpenSSH_9.6 not http\r\n\r\n")) as fu:

        async def test(client: UpstreamClient) -> None:
            with pytest.raises(ProtocolFailure):
                await exchange(client, fu.url)

        run(kind, test)


def test_endless_response_head_is_a_protocol_failure(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "httpx2":
        known_gap(request, "httpx2 reports an oversized head (h11's RemoteProtocolError) as Reset")
    with fault_server(Raw(b"HTTP/1.1 200 OK\r\nx-endless: " + b"a" * (4 * 1024 * 1024))) as fu:

        async def test(client: UpstreamClient) -> None:
            with pytest.raises(ProtocolFailure):
                await exchange(client, fu.url)

        run(kind, test)


# --- failures in the body -----------------------------------------------------------------------------


def test_close_mid_body_is_body_failed(kind: str) -> None:
    with fault_server(Sse(events=2, end="close")) as fu:

        async def test(client: UpstreamClient) -> bytes:
            response = await client.send(fu.url + CHAT, JSON, BODY, RELAXED)
            received: list[bytes] = []
            try:
                with pytest.raises(BodyFailed):
                    await collect(response, received)
            finally:
                await response.close()
            return b"".join(received)

        assert b"fu:1 " in run(kind, test)  # what came before the break was delivered


def test_stall_mid_body_is_an_idle_timeout(kind: str) -> None:
    with fault_server(Sse(events=1, end="stall")) as fu:

        async def test(client: UpstreamClient) -> None:
            timeouts = Timeouts(connect=2.0, first_byte=10.0, idle=0.3)
            response = await client.send(fu.url + CHAT, JSON, BODY, timeouts)
            try:
                with pytest.raises(IdleTimeout):
                    await collect(response, [])
            finally:
                await response.close()

        run(kind, test)
        assert fu.wait_for(lambda: fu.connections[0].eof.is_set())


# --- reading part of a body, and stopping ---------------------------------------------------------------


def test_read_limit_reads_that_much_and_close_aborts(kind: str) -> None:
    size, limit = 10 * 1024 * 1024, 64 * 1024
    with fault_server(HugeBody(status=200, size=size)) as fu:

        async def test(client: UpstreamClient) -> bytes:
            response = await client.send(fu.url + CHAT, JSON, BODY, RELAXED)
            try:
                return await response.read(limit)
            finally:
                await response.close()

        data = run(kind, test)
        assert len(data) == limit
        assert data.startswith(b'{"error":{"message":"eee')
        assert fu.wait_for(lambda: fu.connections[0].eof.is_set())
        assert fu.chat_requests[0].bytes_sent < size  # the rest was never read


def test_close_mid_stream_makes_the_server_see_eof(kind: str) -> None:
    with fault_server(Sse(events=1, end="stall")) as fu:

        async def test(client: UpstreamClient) -> float:
            response = await client.send(fu.url + CHAT, JSON, BODY, RELAXED)
            await anext(response.chunks())
            closed_at = now()
            await response.close()
            return closed_at

        closed_at = run(kind, test)
        record = fu.connections[0]
        assert fu.wait_for(record.eof.is_set)
        assert record.t_eof is not None and record.t_eof >= closed_at


def test_a_reader_that_stops_pauses_the_replica(kind: str) -> None:
    """TCP backpressure: what the replica can write ahead of a stopped reader is bounded by socket
    buffers (the client's 512 KiB receive buffer, doubled by Linux) and a little buffering."""
    with fault_server(Flood(total=64 * 1024 * 1024), sndbuf=64 * 1024) as fu:

        async def test(client: UpstreamClient) -> int:
            response = await client.send(fu.url + CHAT, JSON, BODY, RELAXED)
            try:
                await anext(response.chunks())
                await asyncio.sleep(0.5)
                return fu.chat_requests[0].bytes_sent
            finally:
                await response.close()

        assert run(kind, test) < 4 * 1024 * 1024


# --- probes -------------------------------------------------------------------------------------------


def test_get_status_and_body(kind: str) -> None:
    with fault_server() as fu:

        async def test(client: UpstreamClient) -> tuple[int, bytes]:
            return await client.get(fu.url + "/health", [("authorization", "Bearer k")], 2.0)

        assert run(kind, test) == (200, b'{"status": "ok"}')
        probe = fu.requests[0]
        assert (probe.method, probe.path, probe.header("authorization")) == ("GET", "/health", "Bearer k")


def test_get_body_is_capped(kind: str) -> None:
    size = 3 * PROBE_BODY_LIMIT
    with canned(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + b"m" * size) as server:

        async def test(client: UpstreamClient) -> tuple[int, bytes]:
            return await client.get(server.url + "/metrics", [], 5.0)

        status, body = run(kind, test)
        assert status == 200 and body == b"m" * PROBE_BODY_LIMIT


def test_get_times_out(kind: str) -> None:
    with fault_server(health="timeout") as fu:

        async def test(client: UpstreamClient) -> None:
            with pytest.raises((HeaderTimeout, IdleTimeout)):
                await client.get(fu.url + "/health", [], 0.3)

        run(kind, test)


# --- what the client refuses to send ------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [("x-note", "a\r\nx-injected: 1"), ("x-note", "a\nb"), ("x-note", "a\rb"), ("x-a\r\nx-b", "1")],
    ids=["crlf-value", "lf-value", "cr-value", "crlf-name"],
)
def test_cr_or_lf_in_a_header_is_refused_before_sending(kind: str, header: tuple[str, str]) -> None:
    with canned(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n") as server:

        async def test(client: UpstreamClient) -> None:
            # The lean and aiohttp clients raise ValueError; httpx2 raises its LocalProtocolError,
            # which the client translates like every other httpx2 error.
            with pytest.raises((ValueError, UpstreamError)):
                await client.send(server.url + CHAT, [*JSON, header], BODY, RELAXED)

        run(kind, test)  # closes the client: every connection it opened is then at its end
        server.finish()
        assert not any(server.received), "a request left the client"
