"""One bounded HTTP/1.1 GET to an address already checked: the server tools' only HTTP client.

It connects to the address it is given (guard.py resolved and checked it) and names the host only
in the `Host` header and the TLS server name, so the certificate is verified for the name while
the connection cannot go anywhere else. It follows no redirect (the caller checks each one), asks
for no compression (a small body cannot inflate past the cap), reads at most `max_bytes` of the
body and at most `MAX_HEAD` of the head, and the whole exchange has one deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass

import h11

from gateway.servertools.guard import Target

MAX_HEAD = 64 * 1024
USER_AGENT = "fleet-gateway-server-tools/1"
_READ = 64 * 1024


class FetchFailed(Exception):
    """The server could not be reached or broke the protocol, or the deadline passed."""


@dataclass(frozen=True)
class Fetched:
    """What came back: the status, the headers (lower-case names, the last of each), the body."""

    status: int
    headers: dict[str, str]
    body: bytes
    truncated: bool  # the body went past max_bytes and was cut there


def tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


async def get(
    target: Target,
    address: str,
    *,
    timeout: float,
    max_bytes: int,
    accept: str = "*/*",
    tls: ssl.SSLContext | None = None,
) -> Fetched:
    """GET `target` from `address` within `timeout` seconds, the body cut at `max_bytes`."""
    try:
        async with asyncio.timeout(timeout):
            return await _exchange(target, address, max_bytes, accept, tls)
    except TimeoutError:
        raise FetchFailed(f"no complete answer within {timeout:g} s") from None
    except (OSError, ssl.SSLError, h11.ProtocolError) as exc:
        raise FetchFailed(type(exc).__name__) from None


async def _exchange(
    target: Target, address: str, max_bytes: int, accept: str, tls: ssl.SSLContext | None
) -> Fetched:
    secure = target.scheme == "https"
    reader, writer = await asyncio.open_connection(
        address,
        target.port,
        ssl=(tls or tls_context()) if secure else None,
        server_hostname=target.host if secure else None,
        limit=_READ,
    )
    try:
        connection = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        request = h11.Request(
            method="GET",
            target=target.path,
            headers=[
                ("Host", target.host_header),
                ("User-Agent", USER_AGENT),
                ("Accept", accept),
                ("Accept-Encoding", "identity"),
                ("Connection", "close"),
            ],
        )
        writer.write(connection.send(request) + connection.send(h11.EndOfMessage()))
        await writer.drain()
        return await _response(connection, reader, max_bytes)
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


async def _response(connection: h11.Connection, reader: asyncio.StreamReader, max_bytes: int) -> Fetched:
    head: h11.Response | None = None
    body = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await reader.read(_READ))
            continue
        if isinstance(event, h11.InformationalResponse):
            continue
        if isinstance(event, h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_bytes:
                return _fetched(head, bytes(body[:max_bytes]), truncated=True)
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return _fetched(head, bytes(body), truncated=False)


def _fetched(head: h11.Response | None, body: bytes, *, truncated: bool) -> Fetched:
    if head is None:
        raise FetchFailed("the connection closed before an answer")
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in head.headers}
    return Fetched(head.status_code, headers, body, truncated)
