"""The only door to the replicas: one small interface, and the one place HTTP-client errors are translated.

    UpstreamError
    ├── ConnectFailed      the request never reached the replica: always safe to retry
    ├── Reset              the connection closed or reset before response headers
    ├── HeaderTimeout      no response headers within the first-byte timeout
    ├── ProtocolFailure    the replica answered something that is not HTTP
    ├── BodyFailed         the connection broke while the body was arriving
    └── IdleTimeout        the body stalled for longer than the idle timeout

Three implementations: `lean` (the default: httptools' response parser under an asyncio Protocol,
a quarter of aiohttp's CPU per request, see bench/clients.py), `aiohttp` and `httpx2` (the
maintained continuation of httpx). All are tested against the same contract
(tests/e2e/test_upstream.py), so any can be chosen with `GATEWAY_HTTP_CLIENT`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import ClassVar, NamedTuple, Protocol

from gateway.types import ReadBytes


class UpstreamError(Exception):
    """A transport failure talking to a replica, whatever the client library; `kind` is its bounded
    label in retry records and error codes, and the request path translates it into a
    `GatewayError`."""

    kind: ClassVar[str] = "upstream_error"


class ConnectFailed(UpstreamError):
    """The connection to the replica could not be made: the request never reached it, so a retry is
    safe."""

    kind = "connect_error"


class Reset(UpstreamError):
    """The connection closed or reset before any response headers came."""

    kind = "reset"


class HeaderTimeout(UpstreamError):
    """No response headers arrived within the first-byte timeout."""

    kind = "header_timeout"


class ProtocolFailure(UpstreamError):
    """The replica answered something that is not valid HTTP."""

    kind = "protocol_error"


class BodyFailed(UpstreamError):
    """The connection broke after the headers, while the body was arriving."""

    kind = "upstream_disconnected"


class IdleTimeout(UpstreamError):
    """The body stalled between chunks for longer than the idle timeout."""

    kind = "idle_timeout"


class Timeouts(NamedTuple):
    """One request's timeouts in seconds: to connect, to the response headers, and between body
    chunks."""

    connect: float
    first_byte: float | None  # response headers; None = bounded only by the caller's deadline
    idle: float | None  # between body chunks


class UpstreamResponse(Protocol):
    """A replica's response once its headers arrived: status, headers, and the body read in pieces
    or whole; `close` must be called, and aborts the connection when the body was not read to the
    end."""

    status: int
    headers: Mapping[str, str]  # case-insensitive

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive, without re-chunking."""
        ...

    async def read(self, limit: int | None = None) -> ReadBytes:
        """The body, or its first `limit` bytes (the rest is never read); bytes or a bytearray
        (`ReadBytes`)."""
        ...

    async def close(self) -> None:
        """Release the connection; abort it when the body was not read to the end."""
        ...


class UpstreamClient(Protocol):
    """The HTTP client the gateway reaches replicas with: `send` for requests, `get` for probes,
    `aclose` at shutdown; every failure is raised as an `UpstreamError`. `create_client` picks the
    implementation."""

    async def send(
        self, url: str, headers: list[tuple[str, str]], body: bytes, timeouts: Timeouts, method: str = "POST"
    ) -> UpstreamResponse:
        """One request; POST unless told (a stored Responses answer is read with GET, removed
        with DELETE)."""
        ...

    async def get(self, url: str, headers: list[tuple[str, str]], timeout: float) -> tuple[int, ReadBytes]:
        """A small GET for probes; raises UpstreamError subclasses on failure."""
        ...

    async def aclose(self) -> None: ...


# Below the replicas' own keep-alive (uvicorn: 5 s) so the gateway never reuses a connection the
# replica is closing at that moment (the keep-alive race: a request written onto a connection the
# replica is closing fails with a reset).
KEEPALIVE_EXPIRY = 4.0
PROBE_BODY_LIMIT = 1024 * 1024
# A slow client must not make the gateway hold a replica's burst whole: bodies come in pieces of at
# most this size.
CHUNK_LIMIT = 32 * 1024
# Linux grows a receive buffer up to tcp_rmem's maximum (32 MiB here): a client that reads slowly
# would let its replica generate that much before backpressure reached it.
UPSTREAM_RCVBUF = 512 * 1024


def create_client(kind: str = "lean", keepalive_expiry: float = KEEPALIVE_EXPIRY) -> UpstreamClient:
    """The upstream client named by `kind` (`GATEWAY_HTTP_CLIENT`: `lean`, `aiohttp` or `httpx2`),
    its idle connections dropped after `keepalive_expiry` seconds. Raises `ValueError` for an
    unknown kind or for `aiohttp` without its extra installed."""
    if kind == "aiohttp":
        try:
            from gateway.upstream.aiohttp_client import AiohttpClient
        except ImportError as exc:  # an extra: pip install 'fleet-gateway[aiohttp]'
            raise ValueError(
                "GATEWAY_HTTP_CLIENT=aiohttp needs the aiohttp extra: pip install 'fleet-gateway[aiohttp]'"
            ) from exc

        return AiohttpClient(keepalive_expiry)
    if kind == "httpx2":
        from gateway.upstream.httpx_client import HttpxClient

        return HttpxClient(keepalive_expiry)
    if kind == "lean":
        from gateway.upstream.lean_client import LeanClient

        return LeanClient(keepalive_expiry)
    raise ValueError(f"unknown HTTP client {kind!r}: choose aiohttp, httpx2 or lean")


__all__ = [
    "KEEPALIVE_EXPIRY",
    "BodyFailed",
    "ConnectFailed",
    "HeaderTimeout",
    "IdleTimeout",
    "ProtocolFailure",
    "Reset",
    "Timeouts",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamResponse",
    "create_client",
]
