"""FU, the scripted fake upstream of the reliability and security tests (shared/RELIABILITY.md).

A raw-socket HTTP/1.1 server on asyncio protocols, with no framework in the way, so that it can
misbehave exactly: close or reset before headers, hang, stall mid-stream, cut an event in half,
answer in 1-byte TCP segments, send a 100 MB error body, or close idle keep-alive connections at a
chosen second. Every connection is recorded (request line, headers, body, t_accept, and t_eof: when
the gateway's FIN or RST arrived), because most gates of the catalogue are measured on the upstream
side: "the FU sees EOF within 1.2 s", "B receives exactly one request".

Two ways to run it:
- in a thread of the test process (`FaultServer`), when the test wants the records and shares the
  monotonic clock with its own measurements;
- as a subprocess (`FaultProcess`, `python -m tests.faults --port P --script stream`), when a test
  needs real SIGKILL semantics: the kernel, not Python, closes the sockets.

The end of the module holds the client-side helpers the tests share: a routes.yaml builder, a raw
HTTP/1.1 client that timestamps every body piece, an SSE parser, a metrics reader, and a runner for
the real `fleet-gateway serve` process. Nothing here imports the gateway, so the subprocess starts fast
and cannot be broken by the code under test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http
import itertools
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
CHAT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
PROBE_PATHS = frozenset({"/health", "/v1/models", "/metrics", "/_fu/stats"})
VLLM_METRICS = (
    b'vllm:num_requests_running{model_name="m"} 0.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'
)
MAX_HEAD = 1024 * 1024  # the FU's own request-head limit: a runaway gateway must not eat the test's memory
LOOPBACK = "127.0.0.1"


def now() -> float:
    # CLOCK_MONOTONIC is system-wide on Linux, so FU subprocesses and the test agree on it.
    return time.monotonic()


# --- records --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    conn: Connection
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    t_received: float
    index: int  # position on its connection: > 0 means the gateway reused a keep-alive connection
    behaviour: str = ""
    events_sent: list[float] = field(default_factory=list)  # each SSE event's blank line, when written
    bytes_sent: int = 0
    t_done: float | None = None

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def header(self, name: str) -> str | None:
        values = self.header_values(name)
        return values[0] if values else None

    def header_values(self, name: str) -> list[str]:
        lowered = name.lower()
        return [value for key, value in self.headers if key.lower() == lowered]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(eq=False)
class Connection:
    id: int
    peer: tuple[str, int]
    t_accept: float
    t_eof: float | None = None  # the gateway's FIN or RST; None while open or when the FU closed first
    reset_by_peer: bool = False
    t_closed_by_fu: float | None = None
    t_lost: float | None = None
    requests: list[Request] = field(default_factory=list)
    eof: threading.Event = field(default_factory=threading.Event)  # set on the gateway's FIN/RST
    lost: threading.Event = field(default_factory=threading.Event)  # set however the socket ended

    @property
    def closed(self) -> bool:
        return self.lost.is_set()


class ConnectionGone(Exception):
    """The gateway closed the connection while a behaviour was still writing."""


# --- behaviours -----------------------------------------------------------------------------------------


class Behaviour:
    """One scripted answer. `run` returns True when the connection may serve another request."""

    async def run(self, conn: Conn, req: Request) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class Reply(Behaviour):
    """A whole answer with Content-Length. The default body is a chat completion naming the FU."""

    status: int = 200
    body: bytes | dict[str, Any] | None = None
    headers: tuple[tuple[str, str], ...] = ()
    delay: float = 0.0  # before the status line: time to first byte of a non-streaming answer
    close: bool = False

    async def run(self, conn: Conn, req: Request) -> bool:
        if self.delay and await conn.closed_within(self.delay):
            return False
        body = self.body
        if body is None:
            body = chat_completion(conn.server.name)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = [("content-type", "application/json"), *self.headers]
        if self.close:
            headers.append(("connection", "close"))
        conn.write(req, response_head(self.status, headers, length=len(data)) + data)
        return not self.close


@dataclass(frozen=True)
class Sse(Behaviour):
    """A streamed chat answer: `events` content events `delay` seconds apart, then `end`.

    end: "finish" (finish_reason, usage when asked for, [DONE], terminating chunk), "close" (FIN
    without the terminating chunk, as a killed replica's kernel does), "reset" (RST), "stall" (no
    more bytes until the gateway gives up), "hold" (wait for `gate`, then finish).
    """

    events: int = 3
    delay: float = 0.0
    first_delay: float = 0.0  # before the response headers (time to first byte)
    crlf: bool = False
    ping: bool = False  # a ": ping" comment before every content event, as llama-server sends
    bytewise: bool = False  # every payload byte its own 1-byte chunk and TCP segment (TCP_NODELAY)
    byte_gap: float = 0.0  # between 1-byte writes, so the gateway really reads them one at a time
    big_event: int = 0  # bytes of one extra content event after the first (e.g. 1 MB)
    partial: bytes = b""  # written after the events, just before `end`: half an event
    end: Literal["finish", "close", "reset", "stall", "hold"] = "finish"
    gate: Gate | None = None
    done: bool = True
    framing: Literal["chunked", "close"] = "chunked"
    headers: tuple[tuple[str, str], ...] = ()

    async def run(self, conn: Conn, req: Request) -> bool:
        if self.first_delay and await conn.closed_within(self.first_delay):
            return False
        name = conn.server.name
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache"), *self.headers]
        chunked = self.framing == "chunked"
        if not chunked:
            headers.append(("connection", "close"))
        conn.write(req, response_head(200, headers, chunked=chunked))
        newline = b"\r\n" if self.crlf else b"\n"
        for index in range(self.events):
            if index and self.delay and await conn.closed_within(self.delay):
                return False
            if self.ping:
                await self._send(conn, req, b": ping" + newline + newline, chunked, event=False)
            await self._send(conn, req, sse_frame(content_chunk(name, index), newline), chunked)
            if index == 0 and self.big_event:
                await self._send(
                    conn, req, sse_frame(content_chunk(name, "x" * self.big_event), newline), chunked
                )
        if self.partial:
            await self._send(conn, req, self.partial, chunked, event=False)
        if self.end == "close":
            conn.close()
            return False
        if self.end == "reset":
            conn.reset()
            return False
        if self.end == "stall":
            await conn.wait_lost()
            return False
        if self.end == "hold":
            assert self.gate is not None, "end='hold' needs a gate"
            if not await conn.wait_gate(self.gate):
                return False
        await self._send(conn, req, sse_frame(finish_chunk(name), newline), chunked)
        if wants_usage(req):
            await self._send(conn, req, sse_frame(usage_chunk(name), newline), chunked)
        if self.done:
            await self._send(conn, req, b"data: [DONE]" + newline + newline, chunked)
        if chunked:
            conn.write(req, b"0\r\n\r\n")
            return True
        conn.close()
        return False

    async def _send(self, conn: Conn, req: Request, data: bytes, chunked: bool, event: bool = True) -> None:
        if conn.gone:
            raise ConnectionGone
        # A 1 MB event goes out whole: a million 1-byte writes would time the test, not the gateway.
        if self.bytewise and len(data) <= 64 * 1024:
            for byte in data:
                piece = bytes((byte,))
                conn.write(req, b"1\r\n" + piece + b"\r\n" if chunked else piece)
                if self.byte_gap:
                    await asyncio.sleep(self.byte_gap)
                else:
                    await asyncio.sleep(0)
                if conn.gone:
                    raise ConnectionGone
        else:
            conn.write(req, b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            await conn.drain()
        if event:
            req.events_sent.append(now())


@dataclass(frozen=True)
class Flood(Behaviour):
    """A stream of `total` bytes of SSE, as fast as TCP backpressure lets it go (slow-reader cases)."""

    total: int = 10 * 1024 * 1024
    event_size: int = 1024

    async def run(self, conn: Conn, req: Request) -> bool:
        conn.write(req, response_head(200, [("content-type", "text/event-stream")], chunked=True))
        filler = "y" * max(0, self.event_size - 120)
        frame = sse_frame(content_chunk(conn.server.name, filler), b"\n")
        chunk = b"%x\r\n%s\r\n" % (len(frame) * 16, frame * 16)
        while req.bytes_sent < self.total:
            if conn.gone:
                return False
            conn.write(req, chunk)
            await conn.drain()
        conn.write(req, b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n"))
        return True


@dataclass(frozen=True)
class CloseBeforeHeaders(Behaviour):
    """Read the request, send nothing, FIN: the "empty response" of HAProxy's retry-on list."""

    async def run(self, conn: Conn, req: Request) -> bool:
        conn.close()
        return False


@dataclass(frozen=True)
class ResetBeforeHeaders(Behaviour):
    """Read the request, send nothing, RST (SO_LINGER 0)."""

    async def run(self, conn: Conn, req: Request) -> bool:
        conn.reset()
        return False


@dataclass(frozen=True)
class Hang(Behaviour):
    """No response headers: until the gateway gives up, or for `seconds` and then `then`."""

    seconds: float | None = None
    then: Behaviour | None = None

    async def run(self, conn: Conn, req: Request) -> bool:
        if self.seconds is None:
            await conn.wait_lost()
            return False
        if await conn.closed_within(self.seconds):
            return False
        if self.then is None:
            conn.close()
            return False
        return await self.then.run(conn, req)


@dataclass(frozen=True)
class HugeBody(Behaviour):
    """An error status with a body of `size` bytes (100 MB by default), written as TCP lets it go."""

    status: int = 502
    size: int = 100 * 1024 * 1024
    chunk: int = 64 * 1024

    async def run(self, conn: Conn, req: Request) -> bool:
        prefix = b'{"error":{"message":"'
        suffix = b'"}}'
        conn.write(req, response_head(self.status, [("content-type", "application/json")], length=self.size))
        conn.write(req, prefix)
        filler = b"e" * self.chunk
        left = self.size - len(prefix) - len(suffix)
        while left > 0:
            if conn.gone:
                return False
            piece = filler[: min(left, self.chunk)]
            conn.write(req, piece)
            left -= len(piece)
            await conn.drain()
        conn.write(req, suffix)
        return True


HealthMode = Literal["ok", "fail", "alternate", "timeout"]


# --- wire helpers ---------------------------------------------------------------------------------------


def response_head(
    status: int, headers: Sequence[tuple[str, str]], *, length: int | None = None, chunked: bool = False
) -> bytes:
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{key}: {value}" for key, value in headers]
    if length is not None:
        lines.append(f"content-length: {length}")
    if chunked:
        lines.append("transfer-encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def sse_frame(payload: dict[str, Any], newline: bytes = b"\n") -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + newline + newline


def content_chunk(name: str, index: int | str) -> dict[str, Any]:
    text = f"{name}:{index} " if isinstance(index, int) else index
    return {
        "id": f"chatcmpl-{name}",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }


def finish_chunk(name: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{name}",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }


def usage_chunk(name: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{name}",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def wants_usage(req: Request) -> bool:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return bool(req.json().get("stream_options", {}).get("include_usage"))
    return False


def chat_completion(name: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{name}",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"answer from {name}"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


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


# --- the server -----------------------------------------------------------------------------------------


class Gate:
    """Holds `Sse(end="hold")` streams until the test opens it; safe to open from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def open(self) -> None:
        with self._lock:
            self._open = True
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop has already stopped
                loop.call_soon_threadsafe(event.set)

    async def wait(self) -> None:
        event = asyncio.Event()
        with self._lock:
            if self._open:
                return
            self._waiters.append((asyncio.get_running_loop(), event))
        await event.wait()


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


Route = Callable[[Request], Behaviour]


class FaultServer:
    """The FU in a background thread with its own event loop, on 127.0.0.1.

    POSTs to the chat paths are answered from `script` (a queue, consumed in order), then from
    `route(request)` or `default`. `/health`, `/v1/models`, `/metrics` and `/_fu/stats` are answered
    by the FU itself, outside the script; anything else gets llama-server's 404.
    """

    def __init__(
        self,
        script: Sequence[Behaviour] = (),
        *,
        default: Behaviour | None = None,
        route: Route | None = None,
        name: str = "fu",
        port: int = 0,
        health: HealthMode = "ok",
        idle_close: float | None = None,
        sndbuf: int | None = None,
        model: str = "m",
        context: int = 32768,
    ) -> None:
        self.name = name
        self.script: deque[Behaviour] = deque(script)
        self.default = default or Reply()
        self.route = route
        self.health: HealthMode = health
        self.idle_close = idle_close
        self.sndbuf = sndbuf
        self.model = model
        self.context = context
        self.connections: list[Connection] = []
        self.requests: list[Request] = []
        self.probes: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self.active = 0
        self.max_active = 0
        self._port = port
        self._ids = itertools.count(1)
        self._conns: set[Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None

    # lifecycle

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._port}"

    def start(self) -> FaultServer:
        self._thread = threading.Thread(target=self._run, name=f"fu-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"FU {self.name} did not start")
        if self._failure is not None:
            raise RuntimeError(f"FU {self.name} failed to start") from self._failure
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kill(self) -> None:
        """The replica dies: the listener closes and every connection is reset, as after SIGKILL."""
        self._call(self._kill)

    def push(self, *behaviours: Behaviour) -> None:
        self.script.extend(behaviours)

    # what tests read

    @property
    def chat_requests(self) -> list[Request]:
        return [r for r in self.requests if r.method == "POST" and r.path in CHAT_PATHS]

    @property
    def other_requests(self) -> list[Request]:
        """Requests to paths that are neither the chat paths nor the probes: none should ever come."""
        return [r for r in self.requests if r.path not in CHAT_PATHS and r.path not in PROBE_PATHS]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Block until predicate() holds (re-checked whenever a record changes) or timeout passes."""
        deadline = now() + timeout
        with self._cond:
            while not predicate():
                left = deadline - now()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    # internals

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _call(self, fn: Callable[[], Any]) -> None:
        assert self._loop is not None
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(5)

    def _kill(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.reset()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # reported to start(); a thread must not raise into pytest
            self._failure = exc
            self._ready.set()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Conn(self), LOOPBACK, self._port, backlog=2048, reuse_address=True
        )
        self._port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        self._server.close()
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        await asyncio.sleep(0)  # let the aborted transports run connection_lost

    async def _respond(self, conn: Conn, req: Request) -> bool:
        if req.path == "/health":
            return await self._health(conn, req)
        if req.path == "/v1/models":
            models = {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "owned_by": "vllm", "max_model_len": self.context}
                ],
            }
            return await Reply(body=models).run(conn, req)
        if req.path == "/metrics":
            return await Reply(body=VLLM_METRICS, headers=(("content-type", "text/plain"),)).run(conn, req)
        if req.path == "/_fu/stats":
            return await Reply(body=self.stats()).run(conn, req)
        if req.method != "POST" or req.path not in CHAT_PATHS:
            missing = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
            return await Reply(404, missing).run(conn, req)
        behaviour = self.script.popleft() if self.script else None
        if behaviour is None:
            behaviour = self.route(req) if self.route is not None else self.default
        req.behaviour = type(behaviour).__name__
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self._changed()
        try:
            return await behaviour.run(conn, req)
        finally:
            self.active -= 1
            req.t_done = now()
            self._changed()

    async def _health(self, conn: Conn, req: Request) -> bool:
        mode = self.health
        if mode == "alternate":
            mode = "ok" if len(self.probes) % 2 == 0 else "fail"
        self.probes.append((now(), mode))
        self._changed()
        if mode == "timeout":
            await conn.wait_lost()
            return False
        if mode == "fail":
            loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
            return await Reply(503, loading).run(conn, req)
        return await Reply(200, {"status": "ok"}).run(conn, req)

    def stats(self) -> dict[str, Any]:
        chats = self.chat_requests
        return {
            "name": self.name,
            "chat_requests": len(chats),
            "chat_times": [r.t_received for r in chats],
            "connections": len(self.connections),
            "active": self.active,
            "max_active": self.max_active,
        }


@contextlib.contextmanager
def fault_server(*script: Behaviour, **options: Any) -> Iterator[FaultServer]:
    server = FaultServer(script, **options).start()
    try:
        yield server
    finally:
        server.stop()


# --- subprocess mode ------------------------------------------------------------------------------------

SCRIPTS = ("json", "stream", "hang", "503", "close", "reset")


def scripted(name: str, events: int, delay: float) -> Behaviour:
    if name == "json":
        return Reply(delay=delay)
    if name == "stream":
        return Sse(events=events, delay=delay)
    if name == "hang":
        return Hang()
    if name == "503":
        return Reply(503, {"error": {"message": "busy", "type": "Service Unavailable", "code": 503}})
    if name == "close":
        return CloseBeforeHeaders()
    if name == "reset":
        return ResetBeforeHeaders()
    raise ValueError(f"unknown script {name!r}; choose from {', '.join(SCRIPTS)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description="The scripted fake upstream.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--script", choices=SCRIPTS, default="stream")
    parser.add_argument("--events", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--name", default="fu")
    parser.add_argument("--health", choices=("ok", "fail", "alternate", "timeout"), default="ok")
    parser.add_argument("--idle-close", type=float, default=None)
    args = parser.parse_args(argv)
    server = FaultServer(
        default=scripted(args.script, args.events, args.delay),
        name=args.name,
        port=args.port,
        health=args.health,
        idle_close=args.idle_close,
    ).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"FU READY {server.port}", flush=True)
    stop.wait()
    server.stop()
    return 0


class FaultProcess:
    """The FU as a child process: `kill()` is a real SIGKILL, `start()` again restarts it on its port."""

    def __init__(self, port: int, *args: str) -> None:
        self.port = port
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 15.0) -> FaultProcess:
        command = [sys.executable, "-m", "tests.faults", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
        )
        assert self.proc.stdout is not None
        line = read_line(self.proc.stdout, timeout)
        if not line.startswith(b"FU READY"):
            self.kill()
            raise RuntimeError(f"FU subprocess on port {self.port} did not start: {line!r}")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def stats(self) -> dict[str, Any]:
        response = http_request(("127.0.0.1", self.port), "GET", "/_fu/stats", timeout=5)
        result: dict[str, Any] = json.loads(response.body)
        return result


def read_line(stream: Any, timeout: float) -> bytes:
    """One line from a child's pipe, waiting at most `timeout` seconds."""
    deadline = now() + timeout
    data = b""
    fd = stream.fileno()
    while not data.endswith(b"\n"):
        left = deadline - now()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        piece = os.read(fd, 1)
        if not piece:
            break
        data += piece
    return data


# --- client-side helpers shared by the tests ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def routes_yaml(
    replicas: Sequence[tuple[str, str]],
    *,
    preset: str = "m",
    timeouts: dict[str, float] | None = None,
    retries: dict[str, float] | None = None,
    limits: dict[str, float] | None = None,
    health: dict[str, float] | None = None,
    policy: str = "round_robin",
    params: dict[str, Any] | None = None,
    api_key_env: str | None = None,
    extra_presets: dict[str, Any] | None = None,
) -> str:
    """A routes.yaml (JSON is YAML) with one preset `m` over the given (name, url) replicas.

    Test defaults keep every wait short and every probe quiet: the first probe round runs at start,
    the next only after `health.interval`, so a test controls when health state changes.
    """
    members = []
    for name, url in replicas:
        member: dict[str, Any] = {"name": name, "url": url, "engine": "vllm"}
        if api_key_env:
            member["api_key_env"] = api_key_env
        members.append(member)
    spec: dict[str, Any] = {
        "served_model": "m",
        "aliases": ["alias-m"],
        "policy": policy,
        "min_max_tokens": 0,
        "timeouts": {"connect": 1, "first_byte": 5, "idle": 5, "read": 20, **(timeouts or {})},
        "retries": {"attempts": 2, **(retries or {})},
        "limits": {"max_in_flight": 64, "queue": 32, "queue_timeout": 5, **(limits or {})},
        "replicas": members,
    }
    if params:
        spec["params"] = params
    presets = {preset: spec, **(extra_presets or {})}
    table = {
        "health": {"interval": 60, "timeout": 1, **(health or {})},
        "presets": presets,
        "routing": {"default": preset},
    }
    return json.dumps(table, indent=1)


def chat_body(
    *, stream: bool = False, model: str = "m", content: str = "hello", **extra: Any
) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


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
    host: str = "gateway",
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


@dataclass(frozen=True)
class Event:
    """One SSE event as a client sees it: its data lines joined, and whether it was only a comment."""

    data: str | None
    comment: bool
    raw: bytes


def sse_events(body: bytes) -> list[Event]:
    """Split a text/event-stream body per the SSE spec: CRLF, LF and CR all end lines."""
    text = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    events = []
    for block in text.split(b"\n\n"):
        if not block.strip(b"\n"):
            continue
        lines = block.strip(b"\n").split(b"\n")
        data = [line[5:].removeprefix(b" ") for line in lines if line.startswith(b"data:")]
        comment = all(line.startswith(b":") for line in lines)
        events.append(Event(b"\n".join(data).decode() if data else None, comment, block))
    return events


def data_events(body: bytes) -> list[str]:
    return [event.data for event in sse_events(body) if event.data is not None]


def error_events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for data in data_events(body):
        with contextlib.suppress(ValueError):
            value = json.loads(data)
            if isinstance(value, dict) and "error" in value:
                out.append(value["error"])
    return out


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def series_count(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def established(port_a: int, port_b: int) -> bool:
    """Whether an ESTABLISHED TCP socket joins these two local ports (Linux /proc/net/tcp)."""
    pair = {port_a, port_b}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            next(lines, None)
            for line in lines:
                fields = line.split()
                local, remote, state = fields[1], fields[2], fields[3]
                if (
                    state == "01"
                    and {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)} == pair
                ):
                    return True
    return False


def rss_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or 'self'}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    """Poll a condition that has no event to wait on, within a bounded time."""
    deadline = now() + timeout
    while not predicate():
        if now() > deadline:
            return False
        time.sleep(step)
    return True


class GatewayProcess:
    """The real `fleet-gateway serve` as a child process: for signals (SIGTERM drain, SIGHUP reload)."""

    def __init__(self, routes: Path, port: int, **env: str) -> None:
        self.routes = routes
        self.port = port
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.output_path = routes.with_suffix(".out")

    @property
    def address(self) -> tuple[str, int]:
        return (LOOPBACK, self.port)

    def start(self, timeout: float = 20.0) -> GatewayProcess:
        binary = Path(sys.executable).parent / "fleet-gateway"
        # Only the settings this test chose: a GATEWAY_* variable of the developer's shell must not leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env.update({"GATEWAY_LOG_LEVEL": "info", **self.env})
        with open(self.output_path, "wb") as out:
            self.proc = subprocess.Popen(
                [str(binary), "serve", "--routes", str(self.routes), "--port", str(self.port)],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        ok = wait_until(self._answers, timeout, step=0.05)
        if not ok:
            self.stop()
            raise RuntimeError(f"fleet-gateway did not start:\n{self.output()}")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"fleet-gateway exited with {self.proc.returncode}:\n{self.output()}")
        try:
            return http_request(self.address, "GET", "/health", timeout=1).status == 200
        except OSError:
            return False

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""


def strict_json(data: bytes) -> Any:
    """Parse as RFC 8259 JSON: NaN, Infinity and duplicate keys are errors, not values."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if len(keys) != len(set(keys)):
            raise ValueError(f"duplicate keys: {keys}")
        return dict(pairs)

    return json.loads(data.decode("utf-8"), parse_constant=no_constant, object_pairs_hook=no_duplicates)


_HOST_PORT = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}:\d+")


def addresses_in(text: str) -> list[str]:
    """host:port pairs in a text: a replica address leaking into a message or header."""
    return _HOST_PORT.findall(text)


if __name__ == "__main__":
    raise SystemExit(main())


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


def assert_envelope(
    response: RawResponse, status: int, type_: str, code: str | None = None
) -> dict[str, Any]:
    """The gateway's own error: status, JSON envelope with the four keys, and an x-request-id."""
    assert response.status == status, (response.status, response.body[:500])
    assert response.header("x-request-id"), response.headers
    assert (response.header("content-type") or "").startswith("application/json"), response.headers
    error: dict[str, Any] = response.json()["error"]
    assert {"message", "type", "code", "param"} <= set(error), error
    assert error["type"] == type_, error
    if code is not None:
        assert error["code"] == code, error
    assert isinstance(error["message"], str), error
    assert len(error["message"]) <= 512, error
    return error


def time_of(response: RawResponse, marker: bytes, start: int = 0) -> float | None:
    """When the body first held `marker` (at or after offset `start`), from the piece timestamps."""
    seen = bytearray()
    for at, piece in response.pieces:
        seen += piece
        if seen.find(marker, start) >= 0:
            return at
    return None
