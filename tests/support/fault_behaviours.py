"""FU's script: the behaviours that each answer one request, and the bytes they write.

A behaviour misbehaves exactly: close or reset before headers, hang, stall mid-stream, cut an event
in half, answer in 1-byte TCP segments, flood, or send a 100 MB error body. The wire helpers build the
OpenAI-shaped frames the behaviours send, which the tests reuse to say what they expect.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from tests.support.fault_records import ConnectionGone, Request, now

if TYPE_CHECKING:
    from tests.support.fault_connection import Conn


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
    # Lock-step: the event after the k-th waits for pace[k-1], which the test opens once the client
    # holds the k-th; a relay that held an event back would never get the next one.
    pace: tuple[Gate, ...] = ()
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
        sent = len(req.events_sent)
        if event and 0 < sent <= len(self.pace) and not await conn.wait_gate(self.pace[sent - 1]):
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
class EndlessEvent(Behaviour):
    """One good event, then one `data:` line of `size` bytes that never gets its blank line."""

    size: int = 150 * 1024 * 1024
    chunk: int = 64 * 1024

    async def run(self, conn: Conn, req: Request) -> bool:
        conn.write(req, response_head(200, [("content-type", "text/event-stream")], chunked=True))
        first = sse_frame(content_chunk(conn.server.name, 0), b"\n") + b'data: {"x": "'
        conn.write(req, b"%x\r\n%s\r\n" % (len(first), first))
        piece = b"%x\r\n%s\r\n" % (self.chunk, b"z" * self.chunk)
        for _ in range(self.size // self.chunk):
            if conn.gone:
                return False
            conn.write(req, piece)
            await conn.drain()
        conn.write(req, b"0\r\n\r\n")
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
