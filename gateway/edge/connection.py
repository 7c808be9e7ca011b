"""Limits on a connection while its request head is still arriving, below the ASGI app.

httptools buffers a header until it is complete and uvicorn arms no timer before a first response,
so a client that trickles or never finishes its headers holds a socket and its buffered bytes for
ever (watched: 60 MiB heads held whole, 300 silent sockets starving real requests). This protocol
bounds the head as it is read: a deadline from the connection's first byte (or the next request's)
to the end of its headers, a byte and field count checked after every read, and a cap on open
connections refused before anything is parsed. The exact 64 KiB / 100-field limits stay in
`edge.guard`, where the headers are whole; this layer stops what would never get there.

It also puts the connection's transport behind `edge.corked`, so that a response's head, body and
chunked terminator, written in one turn of the event loop, leave in one system call.
"""

from __future__ import annotations

import asyncio
import os
import time
from asyncio import TimerHandle
from typing import Any, ClassVar, NamedTuple

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.dialects.registry import dialect_for
from gateway.edge.corked import CorkedTransport
from gateway.edge.reject import Recorder, endpoint_label
from gateway.errors import GatewayError, HeadersTooLarge, Overloaded, RequestTimeout
from gateway.ops.exchange import Exchange
from gateway.pipeline.disconnect import ClientLink

# The request line and the blank line come on top of the header bytes the guard counts exactly.
HEAD_SLACK = 16 * 1024
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


class EdgeLimits(NamedTuple):
    """The bounds on a request head while it arrives: its deadline in seconds, its bytes and field
    count (before the slack for the request line), and the most open connections."""

    header_timeout: float
    max_header_bytes: int
    max_header_count: int
    max_connections: int


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline, a byte and a field cap on each request head and
    a cap on open connections; what breaks one is answered (408, 431, 503) in the path's dialect,
    recorded, and the socket closed. `edge_protocol` binds the class to one gateway's limits."""

    limits: ClassVar[EdgeLimits]
    # In a tuple: a function stored as a class attribute would be bound as a method.
    recorder: ClassVar[tuple[Recorder | None]] = (None,)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: TimerHandle | None = None
        self._head_since: float | None = None  # the loop time the open head began; None: none open
        self._head_begun = False  # a byte of the open head's request has arrived
        self._head_bytes = 0
        self._link: ClientLink | None = None  # the latest request's (pipeline/disconnect.py)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # Every write of uvicorn's and ours goes through the cork, so the bytes keep their order.
        super().connection_made(CorkedTransport(transport, self.loop))  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                Overloaded(
                    f"The gateway is at its limit of {self.limits.max_connections} connections; retry soon",
                    headers={"retry-after": "1"},
                )
            )
            return
        self._start_head()
        self._arm_head()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head()
        super().connection_lost(exc)
        if self._link is not None:
            self._link.lost()

    def data_received(self, data: bytes) -> None:
        """Counts the bytes read while a head is open, hands them to httptools, then refuses with
        431 a head that has passed the byte limit (plus slack) or the field count."""
        if self._head_since is not None:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._head_since is None or self.transport.is_closing():
            return
        # Still inside a head after this read: everything counted belongs to it.
        fields = len(self.headers) if self.headers is not None else 0
        if (
            self._head_bytes > self.limits.max_header_bytes + HEAD_SLACK
            or fields > self.limits.max_header_count
        ):
            self._refuse(
                HeadersTooLarge(
                    f"Request headers exceed the limit of {self.limits.max_header_count} fields "
                    f"or {self.limits.max_header_bytes} bytes"
                )
            )
            return
        self._arm_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_since is None:  # a keep-alive connection's next request
            self._start_head()
        self._head_begun = True

    def on_headers_complete(self) -> None:
        self._stop_head()
        # Set before uvicorn starts the app's task (it runs only once this read is parsed).
        self._link = self.scope["gateway.link"] = ClientLink()  # type: ignore[typeddict-unknown-key]
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # The answer is whole: out now, not at the end of the turn (a pipelined request may follow).
        self.transport.flush()  # type: ignore[attr-defined]
        super().on_response_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._link is not None:
            self._link.body_complete = True

    def _start_head(self) -> None:
        self._head_bytes, self._head_begun = 0, False
        self._head_since = self.loop.time()

    def _arm_head(self) -> None:
        """The head's deadline, from its first byte, once a read has ended inside it. A head that
        arrives whole in one read (nearly every request on a kept-alive connection) is done before
        that, and never costs a timer and its cancellation."""
        if self._head_timer is None and self._head_since is not None:
            self._head_timer = self.loop.call_at(
                self._head_since + self.limits.header_timeout, self._head_expired
            )

    def _stop_head(self) -> None:
        self._head_since = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        self._head_since = None
        if self.transport.is_closing():
            return
        if not self._head_begun:  # nothing sent at all: close quietly, as for an idle keep-alive
            self.transport.close()
            return
        self._refuse(
            RequestTimeout(
                f"Request headers did not arrive within {self.limits.header_timeout:g} s",
                code="header_timeout",
            )
        )

    def _refuse(self, error: GatewayError) -> None:
        """Answer in the dialect of the path (as far as it arrived), record it, close the socket."""
        self._stop_head()
        path = (getattr(self, "url", None) or b"").split(b"?", 1)[0].decode("latin-1")
        ex = Exchange(
            request_id=os.urandom(8).hex(),
            endpoint=endpoint_label(path),
            started=time.monotonic(),
            client=self.client[0] if self.client else "",
            outcome="rejected",
        )
        ex.status, ex.error_code = error.status, error.code
        body = dialect_for(path).error_body(error.status, error.type, error.message, error.code, error.param)
        head = [
            b"HTTP/1.1 %d %s\r\n" % (error.status, REASONS[error.status]),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"x-request-id: %s\r\n" % ex.request_id.encode(),
            *(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in error.headers.items()),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
        ex.finished = ex.started
        record = self.recorder[0]
        if record is not None:
            record(ex)


def edge_protocol(limits: EdgeLimits, record: Recorder | None) -> type[EdgeProtocol]:
    """A protocol class bound to one gateway's limits and recorder (uvicorn takes a class)."""
    return type(
        "GatewayHttpProtocol",
        (EdgeProtocol,),
        {"limits": limits, "recorder": (record,)},
    )
