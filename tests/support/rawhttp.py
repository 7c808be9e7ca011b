"""A raw HTTP/1.1 client for the tests, on plain sockets with no library in the way.

Requests are written byte for byte as the test says (bad framing included), and responses are parsed
incrementally with a timestamp on every body piece, so a test can tell when each byte got through
the gateway, not only what arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.support.fault_records import now

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


@dataclass
class RawResponse:
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    pieces: list[tuple[float, bytes]] = field(default_factory=list)  # decoded body bytes, as they arrived
    complete: bool = False  # the body ended as its framing says (last chunk, or Content-Length)
    closed: bool = False  # the server closed the connection
    t_headers: float | None = None
    t_end: float | None = None

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        return next((value for key, value in self.headers if key.lower() == lowered), None)

    def json(self) -> Any:
        return json.loads(self.body)


class HttpReader:
    """An incremental HTTP/1.1 response parser over a blocking socket; timestamps each body piece."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.response = RawResponse()
        self._eof = False

    def _fill(self, deadline: float) -> bool:
        left = deadline - now()
        if left <= 0:
            return False
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(256 * 1024)
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        if not data:
            self._eof = True
            self.response.closed = True
            return False
        self.buffer += data
        return True

    def read_head(self, timeout: float) -> RawResponse:
        deadline = now() + timeout
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill(deadline):
                return self.response
        end = self.buffer.find(b"\r\n\r\n")
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        del self.buffer[: end + 4]
        self.response.status = int(lines[0].split(" ", 2)[1])
        self.response.headers = [
            (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])
        ]
        self.response.t_headers = now()
        return self.response

    def read_body(self, timeout: float, until: Callable[[RawResponse], bool] | None = None) -> RawResponse:
        """Read until the body ends, the server closes, `until(response)` holds, or timeout."""
        response = self.response
        deadline = now() + timeout
        chunked = "chunked" in (response.header("transfer-encoding") or "").lower()
        length_header = response.header("content-length")
        length = int(length_header) if length_header is not None else None
        while not response.complete:
            if until is not None and until(response):
                return response
            progressed = self._take(chunked, length)
            if progressed:
                continue
            if self._eof or not self._fill(deadline):
                if self._eof and not chunked and length is None:
                    response.complete = True  # close-delimited body
                break
        response.t_end = now()
        return response

    def _take(self, chunked: bool, length: int | None) -> bool:
        response = self.response
        if not chunked:
            if length is not None and len(response.body) >= length:
                response.complete = True
                return True
            if not self.buffer:
                return False
            take = len(self.buffer) if length is None else min(len(self.buffer), length - len(response.body))
            self._piece(bytes(self.buffer[:take]))
            del self.buffer[:take]
            if length is not None and len(response.body) >= length:
                response.complete = True
            return True
        line_end = self.buffer.find(b"\r\n")
        if line_end < 0:
            return False
        size = int(bytes(self.buffer[:line_end]).split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            end = self.buffer.find(b"\r\n\r\n", line_end)  # after optional trailers
            if end < 0:
                return False
            del self.buffer[: end + 4]
            response.complete = True
            return True
        if len(self.buffer) < line_end + 2 + size + 2:
            return False
        self._piece(bytes(self.buffer[line_end + 2 : line_end + 2 + size]))
        del self.buffer[: line_end + 2 + size + 2]
        return True

    def _piece(self, data: bytes) -> None:
        self.response.pieces.append((now(), data))
        self.response.body += data


def connect(address: tuple[str, int], timeout: float = 5.0, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        # Set before connect, so the window scale is negotiated for the small buffer.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        raise
    return sock


def encode_request(
    method: str,
    target: str,
    body: bytes | dict[str, Any] | None = None,
    headers: Sequence[tuple[str, str]] = (),
    host: str = "127.0.0.1",
) -> bytes:
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    names = {key.lower() for key, _ in headers}
    lines += [f"{key}: {value}" for key, value in headers]
    if body is not None and "content-length" not in names and "transfer-encoding" not in names:
        lines.append(f"Content-Length: {len(data)}")
    if body is not None and "content-type" not in names:
        lines.append("Content-Type: application/json")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


def http_request(
    address: tuple[str, int],
    method: str,
    target: str,
    body: bytes | dict[str, Any] | None = None,
    headers: Sequence[tuple[str, str]] = (),
    timeout: float = 10.0,
) -> RawResponse:
    """One request on a fresh connection, read to the end of its body (bounded by timeout)."""
    with connect(address, timeout) as sock:
        return send_raw(sock, encode_request(method, target, body, headers), timeout)


def send_raw(sock: socket.socket, data: bytes, timeout: float = 10.0) -> RawResponse:
    sock.sendall(data)
    reader = HttpReader(sock)
    deadline = now() + timeout
    reader.read_head(timeout)
    if reader.response.status:
        reader.read_body(max(0.0, deadline - now()))
    return reader.response


def address_of(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").partition(":")
    return host, int(port.split("/", 1)[0])


def parse_response(data: bytes) -> RawResponse:
    """A whole response read to EOF (requests sent with `Connection: close`)."""

    class _Bytes:
        def __init__(self, payload: bytes) -> None:
            self.payload = payload

        def settimeout(self, _: float) -> None:
            pass

        def recv(self, size: int) -> bytes:
            piece, self.payload = self.payload[:size], self.payload[size:]
            return piece

    reader = HttpReader(_Bytes(data))  # type: ignore[arg-type]
    reader.read_head(1.0)
    if reader.response.status:
        reader.read_body(1.0)
    return reader.response


async def fetch(address: tuple[str, int], data: bytes, timeout: float) -> RawResponse:
    """Send one request (it must say `Connection: close`) and read the answer to EOF, bounded."""
    started = now()
    reader, writer = await asyncio.open_connection(*address)
    received = bytearray()
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            while piece := await reader.read(65536):
                received += piece
    except (TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    response = parse_response(bytes(received))
    response.t_headers = started
    response.t_end = now()
    return response


def fetch_all(address: tuple[str, int], requests: Sequence[bytes], timeout: float) -> list[RawResponse]:
    """Many requests at once, each on its own connection; every one bounded by `timeout`."""

    async def run() -> list[RawResponse]:
        return await asyncio.gather(*(fetch(address, data, timeout) for data in requests))

    return asyncio.run(run())


def time_of(response: RawResponse, marker: bytes, start: int = 0) -> float | None:
    """When the body first held `marker` (at or after offset `start`), from the piece timestamps."""
    seen = bytearray()
    for at, piece in response.pieces:
        seen += piece
        if seen.find(marker, start) >= 0:
            return at
    return None
