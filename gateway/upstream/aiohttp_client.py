"""An upstream client on aiohttp (`GATEWAY_HTTP_CLIENT=aiohttp`); its pool costs a fraction of httpcore's."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import aiohttp

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


@contextmanager
def _before_headers() -> Iterator[None]:
    try:
        yield
    except UpstreamError:
        raise
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        raise ConnectFailed("connection to the replica failed") from exc
    except (aiohttp.SocketTimeoutError, TimeoutError) as exc:
        raise HeaderTimeout("no response headers in time") from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        raise Reset("connection closed before response headers") from exc
    except aiohttp.ClientError as exc:
        raise ProtocolFailure("invalid response from the replica") from exc


@contextmanager
def _in_body() -> Iterator[None]:
    try:
        yield
    except (aiohttp.SocketTimeoutError, TimeoutError) as exc:
        raise IdleTimeout("the response stalled") from exc
    except aiohttp.ClientError as exc:
        raise BodyFailed("connection broke during the response") from exc


# aiohttp pauses reading from the replica when twice this is buffered: what a slow client can make
# the gateway hold per stream stays small, and TCP backpressure does the rest.
READ_BUFFER = 16 * 1024


class _Response:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers
        self._finished = False

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._response.content
        with _in_body():
            while True:
                # Bounded pieces: a slow client must not make the gateway hold a replica's burst whole.
                chunk = await content.read(CHUNK_LIMIT)
                if not chunk:
                    break
                yield chunk
        self._finished = True

    async def read(self, limit: int | None = None) -> bytes:
        """The body, or its first `limit` bytes (reading stops once that many arrived); a failure
        while reading raises `IdleTimeout` or `BodyFailed`."""
        with _in_body():
            if limit is None:
                data = await self._response.read()
                self._finished = True
                return data
            parts: list[bytes] = []
            size = 0
            while size < limit:
                chunk = await self._response.content.readany()
                if not chunk:
                    self._finished = True
                    break
                parts.append(chunk)
                size += len(chunk)
        return b"".join(parts)[:limit]

    async def close(self) -> None:
        if self._finished:
            self._response.release()
        else:
            # Closing the socket is how the replica learns nobody is listening: vLLM aborts the
            # request, llama-server frees the slot.
            self._response.close()


def _socket(addr_info: tuple[Any, ...]) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    # Linux grows a receive buffer up to tcp_rmem's maximum (32 MiB here): a client that reads
    # slowly would let its replica generate that much before backpressure reached it.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UPSTREAM_RCVBUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class AiohttpClient:
    """The upstream client on aiohttp: one session created on first use, with no connection cap
    below the gateway's admission limits, small receive buffers for backpressure, no redirects,
    cookies or decompression; aiohttp's errors are raised as `UpstreamError`s."""

    def __init__(self, keepalive_expiry: float) -> None:
        self._keepalive_expiry = keepalive_expiry
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple[float, float | None], aiohttp.ClientTimeout] = {}

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # limit=0: no hidden cap below the gateway's own admission limits (aiohttp defaults to 100).
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=self._keepalive_expiry, socket_factory=_socket
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                read_bufsize=READ_BUFFER,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=None),
                trust_env=False,
            )
        return self._session

    async def send(
        self, url: str, headers: list[tuple[str, str]], body: bytes, timeouts: Timeouts, method: str = "POST"
    ) -> _Response:
        """Sends one request and returns once its response headers arrived (within
        `timeouts.first_byte` when set), the body left to read; the connect and idle timeouts apply
        per socket operation. Failures before the headers raise `ConnectFailed`, `HeaderTimeout`,
        `Reset` or `ProtocolFailure`."""
        timeout = self._timeouts.get((timeouts.connect, timeouts.idle))
        if timeout is None:
            timeout = aiohttp.ClientTimeout(
                total=None, connect=None, sock_connect=timeouts.connect, sock_read=timeouts.idle
            )
            self._timeouts[(timeouts.connect, timeouts.idle)] = timeout
        request = self._get_session().request(
            method, url, data=body, headers=headers, timeout=timeout, allow_redirects=False
        )
        with _before_headers():
            if timeouts.first_byte is None:
                response = await request
            else:
                async with asyncio.timeout(timeouts.first_byte):
                    response = await request
        return _Response(response)

    async def get(self, url: str, headers: list[tuple[str, str]], timeout: float) -> tuple[int, bytes]:
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        with _before_headers():
            async with self._get_session().get(
                url, headers=headers, timeout=client_timeout, allow_redirects=False
            ) as response:
                return response.status, await _Response(response).read(PROBE_BODY_LIMIT)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
