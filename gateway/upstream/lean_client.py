"""A lean upstream client: httptools' response parser under one asyncio Protocol per connection.

Per request it costs a fraction of aiohttp's CPU (see bench/clients.py), because it does only
what the gateway needs: HTTP/1.1, POST and GET, no redirects, no cookies, no decompression, no
connection cap (the gateway's admission limits are the only limits). A pool is a deque of idle
connections per origin; the newest is reused first, and a connection is reused only when its
previous response allowed it, its request did not say `connection: close`, the replica has not
closed it, and it has been idle for less than the keep-alive expiry.

Response headers are a dict with lowercase names whose `get` lowercases its key (the gateway reads
headers only with `get`); repeated headers are joined with ", ".
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools

from gateway.caught import Caught, raise_again
from gateway.types import ReadBytes
from gateway.upstream import (
    CHUNK_LIMIT,
    PROBE_BODY_LIMIT,
    UPSTREAM_RCVBUF,
    BodyFailed,
    ConnectFailed,
    HeaderTimeout,
    IdleTimeout,
    ProtocolFailure,
    Reset,
    Timeouts,
    UpstreamError,
)

PAUSE_ABOVE = 64 * 1024  # unconsumed bytes held before reading pauses and TCP backpressure takes over
RESUME_BELOW = 16 * 1024
# httptools bounds no header: a replica gone wrong could make a head grow without end (aiohttp's
# parser stops at 8 KiB a line).
MAX_HEAD = 256 * 1024
DNS_TTL = 10.0  # as aiohttp: a restarted replica behind a name is found again within seconds
_OWN = frozenset({"host", "content-length", "transfer-encoding"})  # written by the client itself

Origin = tuple[str, str, int]


class Headers(dict[str, str]):
    """Lowercase names; `get` lowercases its key, so it is case-insensitive (`[]` and `in` are not)."""

    def get(self, key: str, default: Any = None) -> Any:
        return dict.get(self, key.lower(), default)


class _Conn(asyncio.Protocol):
    """One connection, and the state of the one response it is receiving."""

    transport: asyncio.Transport

    def __init__(self, origin: Origin, loop: asyncio.AbstractEventLoop, conns: set[_Conn]) -> None:
        self.origin, self.loop, self.conns = origin, loop, conns
        self.active = False  # a request is in flight; bytes on an idle connection are a broken replica
        self.idle_since = 0.0
        self.waiter: asyncio.Future[bool] | None = None

    def begin(self, request: bytes, body: bytes) -> None:
        # A fresh parser per response: no state leaks from one answer into the next.
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers = Headers()
        self.headers_done = self.complete = self.keep_alive = self.paused = False
        self.informational = False  # between a 1xx's headers and its end
        self.error: type[UpstreamError] | None = None
        self.buffer: deque[bytes] = deque()
        self.buffered = self.head_size = 0
        self.active = True
        if len(body) <= 65536:
            self.transport.write(request + body)
        else:  # no copy of a large body just to save a syscall
            self.transport.write(request)
            self.transport.write(body)

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.conns.add(self)

    def data_received(self, data: bytes) -> None:
        if not self.active:
            self.abort()
            return
        if not self.headers_done:
            self.head_size += len(data)
            if self.head_size > MAX_HEAD:
                self.fail(ProtocolFailure)
                self.wake()
                return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            if self.complete:  # bytes after a whole answer: keep the answer, not the connection
                self.abort()
            else:
                self.fail(BodyFailed if self.headers_done else ProtocolFailure)
        if self.waiter is not None and (self.headers_done or self.error is not None):
            self.wake()

    def eof_received(self) -> bool:
        self.ended(None)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        self.ended(exc)

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            raise ValueError("a second response to one request")

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        previous = dict.get(self.headers, key)
        self.headers[key] = text if previous is None else f"{previous}, {text}"

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx informational: the final response follows on the same connection
            self.informational = True
            self.headers = Headers()
            return
        self.status, self.headers_done = status, True

    def on_body(self, body: bytes) -> None:
        self.buffer.append(body)
        self.buffered += len(body)
        if self.buffered > PAUSE_ABOVE and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    # state changes

    def ended(self, exc: Exception | None) -> None:
        if not self.active or self.complete or self.error is not None:
            self.abort()
            return
        if not self.headers_done:
            self.fail(Reset)
        elif (
            exc is None
            and "content-length" not in self.headers
            and "chunked" not in self.headers.get("transfer-encoding", "").lower()
        ):
            # Neither a length nor chunked framing: the body is delimited by the connection's end.
            self.complete, self.keep_alive = True, False
        else:
            self.fail(BodyFailed)
        self.wake()

    def fail(self, error: type[UpstreamError]) -> None:
        if self.error is None:
            self.error = error
        self.abort()

    def abort(self) -> None:
        # Closing the socket is how the replica learns nobody is listening: vLLM aborts the
        # request, llama-server frees the slot.
        self.transport.abort()

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    async def wait(self, deadline: float | None) -> bool:
        """Until the protocol has news (True) or the deadline passes (False)."""
        waiter: asyncio.Future[bool] = self.loop.create_future()
        self.waiter = waiter
        timer = None if deadline is None else self.loop.call_at(deadline, _expire, waiter)
        try:
            return await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def take(self, limit: int) -> bytes:
        """Buffered body bytes, coalesced, at most `limit`."""
        buffer = self.buffer
        piece = buffer.popleft()
        if len(piece) > limit:
            # The rest split once into pieces of CHUNK_LIMIT: no byte of a large read is copied twice.
            rest = range(limit, len(piece), CHUNK_LIMIT)
            buffer.extendleft(reversed([piece[at : at + CHUNK_LIMIT] for at in rest]))
            piece = piece[:limit]
        elif buffer and len(piece) + len(buffer[0]) <= limit:
            parts = [piece]
            size = len(piece)
            while buffer and size + len(buffer[0]) <= limit:
                parts.append(buffer.popleft())
                size += len(parts[-1])
            piece = b"".join(parts)
        self.buffered -= len(piece)
        if self.paused and self.buffered < RESUME_BELOW:
            self.paused = False
            self.transport.resume_reading()
        return piece


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class _Response:
    def __init__(
        self, client: LeanClient, conn: _Conn, reusable: bool, idle: float | None, deadline: float | None
    ) -> None:
        self._client, self._conn, self._reusable = client, conn, reusable
        self._idle, self._deadline = idle, deadline  # probes: one overall deadline, no idle timeout
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers
        self._released = False

    async def _fill(self) -> bool:
        """Until body bytes are buffered (True) or the body has ended (False)."""
        conn = self._conn
        while not conn.buffer:
            if conn.complete:
                return False
            if conn.error is not None:
                raise conn.error("connection broke during the response")
            deadline = self._deadline
            if deadline is None and self._idle is not None:
                deadline = conn.loop.time() + self._idle
            if not await conn.wait(deadline):
                raise IdleTimeout("the response stalled")
        return True

    def chunks(self) -> AsyncIterator[bytes]:
        # The response is its own iterator: an async generator would cost the loop's finaliser hooks.
        return self

    def __aiter__(self) -> _Response:
        return self

    async def __anext__(self) -> bytes:
        # Bytes already buffered (a slow consumer, a burst) cost no further coroutine.
        if self._conn.buffer or await self._fill():
            return self._conn.take(CHUNK_LIMIT)
        raise StopAsyncIteration

    async def read(self, limit: int | None = None) -> ReadBytes:
        # Gathered into one growing buffer, never joined at the end: a 60 MiB answer must not be held
        # twice (the pieces and their join) at its peak.
        out = bytearray()
        while (limit is None or len(out) < limit) and await self._fill():
            out += self._conn.take(1 << 62 if limit is None else limit - len(out))
        return out

    async def close(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.active = False
        if self._reusable and conn.complete and conn.keep_alive and not conn.buffer and conn.error is None:
            self._client._release(conn)
        else:
            conn.abort()


class LeanClient:
    def __init__(self, keepalive_expiry: float) -> None:
        self._expiry = keepalive_expiry
        self._pools: dict[Origin, deque[_Conn]] = {}
        self._conns: set[_Conn] = set()  # every open connection, for aclose
        self._targets: dict[str, tuple[Origin, str, str]] = {}
        self._dns: dict[tuple[str, int], tuple[float, list[Any]]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def send(
        self, url: str, headers: list[tuple[str, str]], body: bytes, timeouts: Timeouts, method: str = "POST"
    ) -> _Response:
        loop = asyncio.get_running_loop()
        deadline = None if timeouts.first_byte is None else loop.time() + timeouts.first_byte
        conn, reusable = await self._exchange(loop, method, url, headers, body, timeouts.connect, deadline)
        return _Response(self, conn, reusable, timeouts.idle, None)

    async def get(self, url: str, headers: list[tuple[str, str]], timeout: float) -> tuple[int, ReadBytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn, reusable = await self._exchange(loop, "GET", url, headers, b"", timeout, deadline)
        response = _Response(self, conn, reusable, None, deadline)
        caught: Caught[BaseException] | None = None
        try:
            body = await response.read(PROBE_BODY_LIMIT)
        except BaseException as error:
            caught = Caught(error)
        await response.close()
        raise_again(caught)
        return response.status, body

    async def _exchange(
        self,
        loop: asyncio.AbstractEventLoop,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        connect_timeout: float,
        header_deadline: float | None,
    ) -> tuple[_Conn, bool]:
        """Write the request; return its connection once the response headers are in, and whether
        the request allows the connection to be reused."""
        origin, target, host = self._target(url)
        lines = [f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n"]
        reusable = True
        for name, value in headers:
            lowered = name.lower()
            if lowered in _OWN:
                continue
            if lowered == "connection" and "close" in value.lower():
                reusable = False  # llama-server streams: see attempts.upstream_headers
            lines.append(f"{name}: {value}\r\n")
        if body or method == "POST":
            lines.append(f"content-length: {len(body)}\r\n")
        text = "".join(lines)
        # Exactly one CR and one LF per line written (two in the first): any other would let a
        # value, a name or the URL inject a header or a second request.
        if text.count("\r") != len(lines) + 1 or text.count("\n") != len(lines) + 1 or "\0" in text:
            raise ValueError("CR, LF or NUL in an upstream request header")
        request = (text + "\r\n").encode("latin-1")  # what uvicorn decoded as latin-1 goes back as it came
        conn = self._idle_conn(origin, loop.time()) or await self._connect(loop, origin, connect_timeout)
        try:
            conn.begin(request, body)
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error("no response headers from the replica")
                if not await conn.wait(header_deadline):
                    raise HeaderTimeout("no response headers in time")
        except BaseException:
            conn.active = False
            conn.abort()
            raise
        return conn, reusable

    def _target(self, url: str) -> tuple[Origin, str, str]:
        """The pool's key, the request target and the host header of a URL (cached: a few distinct)."""
        found = self._targets.get(url)
        if found is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {url!r}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            if " " in target:
                raise ValueError("a space in an upstream URL")
            found = ((parts.scheme, parts.hostname, port), target, parts.netloc.rpartition("@")[2])
            if len(self._targets) > 1024:  # a bound, should URLs ever carry per-request parts
                self._targets.clear()
            self._targets[url] = found
        return found

    def _idle_conn(self, origin: Origin, now: float) -> _Conn | None:
        pool = self._pools.get(origin)
        while pool:
            conn = pool.pop()  # the newest: the furthest from the replica's own keep-alive timeout
            if now - conn.idle_since < self._expiry and not conn.transport.is_closing():
                return conn
            conn.abort()
        return None

    def _release(self, conn: _Conn) -> None:
        if conn.transport.is_closing():
            return
        if conn.paused:
            conn.paused = False
            conn.transport.resume_reading()
        conn.idle_since = conn.loop.time()
        self._pools.setdefault(conn.origin, deque()).append(conn)
        if self._sweeper is None:
            self._sweeper = conn.loop.call_later(self._expiry, self._sweep)

    def _sweep(self) -> None:
        # Idle connections past the expiry are closed here, not left open until the replica closes them.
        loop = asyncio.get_running_loop()
        for pool in self._pools.values():
            while pool and loop.time() - pool[0].idle_since >= self._expiry:
                pool.popleft().abort()
        self._sweeper = loop.call_later(self._expiry / 2, self._sweep) if any(self._pools.values()) else None

    async def _connect(self, loop: asyncio.AbstractEventLoop, origin: Origin, timeout: float) -> _Conn:
        scheme, host, port = origin
        try:
            async with asyncio.timeout(timeout):
                sock = await self._socket(loop, host, port)
                context = None
                if scheme == "https":
                    context = self._ssl = self._ssl or ssl.create_default_context()
                try:
                    _, conn = await loop.create_connection(
                        lambda: _Conn(origin, loop, self._conns),
                        sock=sock,
                        ssl=context,
                        server_hostname=host if context else None,
                    )
                except BaseException:
                    sock.close()
                    raise
        except (OSError, TimeoutError) as exc:  # refused, unresolvable, unreachable, TLS, too slow
            raise ConnectFailed(f"connection to {host}:{port} failed") from exc
        return conn

    async def _socket(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
        """A socket connected to the first address of `host` that accepts."""
        cached = self._dns.get((host, port))
        if cached is None or cached[0] <= loop.time():
            # Cached: a `connection: close` stream makes a new connection per request.
            cached = (loop.time() + DNS_TTL, await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            self._dns[(host, port)] = cached
        error: OSError = ConnectionRefusedError(f"{host} has no address")
        for family, type_, proto, _, address in cached[1]:
            sock = socket.socket(family, type_, proto)
            try:
                # Before connect: the receive window is negotiated in the handshake.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UPSTREAM_RCVBUF)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
                return sock
            except BaseException as exc:
                sock.close()
                if not isinstance(exc, OSError):
                    raise
                error = exc
        raise error

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._conns):
            conn.abort()
        self._pools.clear()
        await asyncio.sleep(0)  # let the transports run connection_lost
