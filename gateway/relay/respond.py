"""The answer to the client: one `Responder` per request, the only writer to its ASGI `send`.

It alone knows whether the status line went out (`started`) and whether the gateway opened a
stream itself before any replica answered (`opened`: loading comments). That decides what a
failure becomes (Envoy's rule): before the status line, a proper error response in the client's
dialect; on a stream the gateway opened, the dialect's one error event and the end of the stream;
once a replica's own answer is being relayed, the relay ends it (stream.py) or the failure is
raised on, since no reply can follow a started one.

The request's record (`Exchange`) gets the status that went out; nothing else reads these flags.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.dialects.base import Dialect
from gateway.dialects.openai import OPENAI
from gateway.errors import MAX_MESSAGE, GatewayError, NoUpstream
from gateway.ops.exchange import Exchange
from gateway.relay.replica_message import upstream_error, upstream_error_body
from gateway.types import ReadBytes, Send


def gateway_headers(ex: Exchange) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-request-id", ex.request_id.encode())]
    if ex.preset != "unknown":
        headers.append((b"x-gateway-preset", ex.preset.encode()))
        headers.append((b"x-gateway-route", ex.route.encode()))
    if ex.replica:
        headers.append((b"x-gateway-replica", ex.replica.encode()))
    if ex.rewrites:
        headers.append((b"x-gateway-rewrites", ",".join(text for _, text in ex.rewrites).encode()))
    if ex.fallback:
        headers.append((b"x-gateway-fallback", ex.fallback.encode()))
    if ex.prefix:
        headers.append((b"x-gateway-prefix", ex.prefix.encode()))
    if ex.prefix_found:
        warning = "volatile content in the system prompt: " + ",".join(ex.prefix_found)
        headers.append((b"x-gateway-prefix-warning", warning.encode()))
    return headers


def stream_head(ex: Exchange, content_type: bytes = b"text/event-stream") -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", content_type),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        *gateway_headers(ex),
    ]


async def send_error(send: Send, ex: Exchange, error: GatewayError, dialect: Dialect = OPENAI) -> None:
    """The gateway's own answer, in the envelope the client's dialect expects."""
    body = dialect.error_body(error.status, error.type, error.message, error.code, error.param)
    ex.status, ex.error_code = error.status, error.code
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *gateway_headers(ex),
        *((k.encode(), v.encode()) for k, v in error.headers.items()),
    ]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Responder:
    """Writes one request's answer; see the module docstring for what a failure becomes when."""

    __slots__ = (
        "_writing",
        "clock",
        "dialect",
        "ex",
        "input_tokens",
        "model",
        "opened",
        "send",
        "spliced",
        "started",
        "streaming",
    )

    def __init__(self, send: Send, ex: Exchange, dialect: Dialect, clock: Callable[[], float]) -> None:
        self.send, self.ex, self.dialect, self.clock = send, ex, dialect, clock
        self.started = False  # the status line went out
        self.opened = False  # ... on a stream the gateway opened itself, with no replica's stream in it
        self.spliced = False  # ... with the dialect's opening events: the replica's are to be dropped
        self.streaming = False  # the client asked for a stream (known once its body is parsed)
        self.model: str | None = None  # the model the client named, for answers the gateway writes
        self.input_tokens = 0  # the prompt's tokens, for an opening event that reports them
        self._writing: asyncio.Lock | None = None

    @property
    def writing(self) -> asyncio.Lock:
        """Held by whoever writes while the request waits (the keep-alive task, loading comments);
        made on first use, as most requests never wait."""
        if self._writing is None:
            self._writing = asyncio.Lock()
        return self._writing

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        self.started = True
        self.ex.status = status

    async def body(self, data: ReadBytes, more: bool = True) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def fail(self, error: GatewayError) -> None:
        """The gateway's own failure, in the dialect's terms (dialects/base.py `error_reply`): an
        error response, or events that end the stream. Raises it on when a replica's answer already
        started (the caller cannot reply any more)."""
        if self.started and not self.opened:
            raise error
        ex = self.ex
        reply = self.dialect.error_reply(
            error, streaming=self.streaming, opened=self.opened, request_id=ex.request_id, model=self.model
        )
        ex.error_code, ex.key_limit = str(error.code), error.key_limit
        if reply.stream:
            if not self.started:
                await self.start(200, stream_head(ex))
            await self.body(reply.body)
            await self.body(b"", more=False)
            self.opened = False
            return
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(reply.body)).encode()),
            *gateway_headers(ex),
            *((k.encode(), v.encode()) for k, v in reply.headers),
        ]
        if reply.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await self.start(reply.status, headers)
        await self.body(reply.body, more=False)

    async def replica_error(self, status: int, data: ReadBytes, secrets: tuple[str, ...]) -> None:
        """A replica's own 4xx: its status and scrubbed message, in the client's envelope (or, on a
        stream the gateway opened, its error event)."""
        ex = self.ex
        ex.error_code = str(status)
        if self.opened:
            ex.outcome = "upstream_error"
            message = upstream_error(status, data, secrets, self.dialect)[0]
            await self.end(message, str(status))
            return
        body = upstream_error_body(status, data, ex.request_id, secrets, self.dialect)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *gateway_headers(ex),
        ]
        await self.start(status, headers)
        await self.body(body, more=False)

    async def open_stream(self) -> None:
        """Open the stream before any replica answered: the status line and the dialect's opening
        events (relay/keepalive.py says why); once."""
        if self.started:
            return
        await self.start(200, stream_head(self.ex))
        self.opened = True
        ex = self.ex
        opening = self.dialect.opening(
            request_id=ex.request_id, model=self.model, input_tokens=self.input_tokens
        )
        if opening:
            self.spliced = True
            await self.body(opening)

    async def loading(self, preset: str, seconds: float) -> None:
        """While a launched replica starts: open the stream (once) and say so in an SSE comment,
        which every client's parser skips; the replica's events follow on the same stream."""
        async with self.writing:
            await self.open_stream()
            await self.comment(f"loading {preset}, {seconds:.0f} s")

    async def comment(self, text: str) -> None:
        """An SSE comment on a stream the gateway opened itself."""
        if self.opened:
            await self.body(f": {text}\n\n".encode())

    async def shutdown(self) -> None:
        """The server stops and the drain period is over: say so rather than go silent."""
        ex = self.ex
        ex.outcome, ex.error_code = "upstream_error", "shutdown"
        message = f"The gateway is shutting down; request {ex.request_id} was cut off"
        if self.started and ex.stream:
            await self.end(message, "shutdown")
        elif not self.started:
            await self.fail(NoUpstream(message, code="shutdown", headers={"retry-after": "5"}))

    async def end(self, message: str, code: str) -> None:
        """End a stream the gateway must stop: the dialect's one error event, no terminator."""
        self.ex.error_code = code
        await self.body(self.dialect.stream_error(message[:MAX_MESSAGE], code))
        await self.body(b"", more=False)
        self.opened = False
