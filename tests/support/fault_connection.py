"""One connection accepted by FU: an asyncio protocol that parses the gateway's requests, runs the
script's behaviours on them one at a time, and records when the gateway's FIN or RST arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from typing import TYPE_CHECKING

from tests.support.fault_behaviours import Gate, response_head
from tests.support.fault_records import Connection, ConnectionGone, Request, now

if TYPE_CHECKING:
    from tests.support.faults import FaultServer

MAX_HEAD = 1024 * 1024  # the FU's own request-head limit: a runaway gateway must not eat the test's memory


class Conn(asyncio.Protocol):
    """One accepted connection: parses requests, runs behaviours one at a time, records everything."""

    def __init__(self, server: FaultServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.record: Connection | None = None
        self.gone = False
        self._buffer = bytearray()
        self._head: tuple[str, str, str, list[tuple[str, str]]] | None = None
        self._queue: deque[Request] = deque()
        self._arrived = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._lost = asyncio.Event()
        self._idle: asyncio.TimerHandle | None = None

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.server.sndbuf:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.server.sndbuf)
        peer = transport.get_extra_info("peername") or ("", 0)
        self.record = Connection(next(self.server._ids), (peer[0], peer[1]), now())
        self.server.connections.append(self.record)
        self.server._conns.add(self)
        task = asyncio.get_running_loop().create_task(self._serve())
        self.server._tasks.add(task)
        task.add_done_callback(self.server._tasks.discard)
        self.server._changed()

    def data_received(self, data: bytes) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self._buffer += data
        try:
            self._parse()
        except ValueError:
            self.write(None, response_head(400, [("content-length", "0"), ("connection", "close")]))
            self.close()

    def eof_received(self) -> bool:
        self._peer_gone(reset=False)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self._peer_gone(reset=True)
        self.gone = True
        if self._idle is not None:
            self._idle.cancel()
        assert self.record is not None
        self.record.t_lost = now()
        self.record.lost.set()
        self._lost.set()
        self._writable.set()
        self._arrived.set()
        self.server._conns.discard(self)
        self.server._changed()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # what behaviours use

    def write(self, req: Request | None, data: bytes) -> None:
        if self.gone or self.transport is None or self.transport.is_closing():
            return
        self.transport.write(data)
        if req is not None:
            req.bytes_sent += len(data)

    async def drain(self) -> None:
        await self._writable.wait()
        # A closing transport drops writes (see write()): a behaviour that loops until it has sent
        # enough would spin for good, holding the GIL in a thread that stop() can no longer join.
        if self.gone or self.transport is None or self.transport.is_closing():
            raise ConnectionGone

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            assert self.record is not None
            self.record.t_closed_by_fu = self.record.t_closed_by_fu or now()
            self.transport.close()

    def reset(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            assert self.record is not None
            self.record.t_closed_by_fu = self.record.t_closed_by_fu or now()
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

    async def wait_lost(self) -> None:
        await self._lost.wait()

    async def closed_within(self, seconds: float) -> bool:
        """Sleep, but wake at once if the gateway leaves; True when it did."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._lost.wait()
        return self.gone

    async def wait_gate(self, gate: Gate) -> bool:
        """True once the gate opens; False if the gateway left first."""
        opened = asyncio.ensure_future(gate.wait())
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            await asyncio.wait({opened, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            opened.cancel()
            lost.cancel()
        return not self.gone

    # internals

    def _peer_gone(self, reset: bool) -> None:
        record = self.record
        assert record is not None
        if record.t_eof is None and record.t_closed_by_fu is None:
            record.t_eof = now()
            record.reset_by_peer = reset
            record.eof.set()
            self.server._changed()

    def _parse(self) -> None:
        assert self.record is not None
        while True:
            if self._head is None:
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buffer) > MAX_HEAD:
                        raise ValueError("request head too large")
                    return
                lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
                del self._buffer[: end + 4]
                method, target, version = lines[0].split(" ", 2)
                headers = []
                for line in lines[1:]:
                    key, sep, value = line.partition(":")
                    if not sep:
                        raise ValueError("header line without a colon")
                    headers.append((key.strip(), value.strip()))
                self._head = (method, target, version, headers)
            method, target, version, headers = self._head
            names = {key.lower(): value for key, value in headers}
            # The head is parsed once and the body is only measured until it is complete: an 8 MiB
            # body arriving in 64 KiB reads must not be copied on every read (the GIL is shared
            # with the test's own clocks).
            if "chunked" in names.get("transfer-encoding", "").lower():
                if not self._buffer.endswith(b"\r\n\r\n"):
                    return
                decoded = _decode_chunked(self._buffer)
                if decoded is None:
                    return
                body, used = decoded
            else:
                length = int(names.get("content-length", "0") or "0")
                if len(self._buffer) < length:
                    return
                body, used = bytes(self._buffer[:length]), length
            del self._buffer[:used]
            self._head = None
            index = len(self.record.requests)
            req = Request(self.record, method, target, version, headers, body, now(), index)
            self.record.requests.append(req)
            self.server.requests.append(req)
            self._queue.append(req)
            self._arrived.set()
            self.server._changed()

    async def _serve(self) -> None:
        try:
            while True:
                while not self._queue:
                    if self.gone:
                        return
                    self._arrived.clear()
                    await self._arrived.wait()
                req = self._queue.popleft()
                keep = await self.server._respond(self, req)
                if self.gone:
                    return
                if not keep:
                    self.close()
                    return
                if not self._queue and self.server.idle_close is not None:
                    loop = asyncio.get_running_loop()
                    self._idle = loop.call_later(self.server.idle_close, self._idle_expired)
        except ConnectionGone:
            return
        except Exception as exc:  # a bug in a behaviour: recorded for the test, never raised into the loop
            self.server.errors.append(repr(exc))
            self.reset()

    def _idle_expired(self) -> None:
        # As uvicorn does at timeout_keep_alive: a FIN on a connection with no request in progress.
        self._idle = None
        if not self._queue and not self._buffer and self._head is None:
            self.close()


def _decode_chunked(data: bytes | bytearray) -> tuple[bytes, int] | None:
    """(body, bytes consumed) of a complete chunked body at the start of data, else None."""
    body = bytearray()
    at = 0
    while True:
        line_end = data.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(bytes(data[at:line_end]).split(b";", 1)[0].strip() or b"0", 16)
        at = line_end + 2
        if size == 0:
            trailer_end = data.find(b"\r\n\r\n", at - 2)
            return (bytes(body), trailer_end + 4) if trailer_end >= 0 else None
        if len(data) < at + size + 2:
            return None
        body += data[at : at + size]
        at += size + 2
