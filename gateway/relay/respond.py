"""Sending answers to the client: a replica's response (streamed or whole) or the gateway's own error.

Before the first byte reaches the client a failure is still a proper HTTP error; after it, a stream
can only be ended with one `data: {"error": ...}` event and no `[DONE]` (Envoy's rule: local reply
before headers, cut the stream after).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import orjson

from gateway.dialects.answer import TRAP_WARNING
from gateway.dialects.base import Dialect
from gateway.dialects.openai import OPENAI
from gateway.errors import MAX_MESSAGE, GatewayError, UpstreamFailure
from gateway.ops.exchange import Exchange
from gateway.relay.sse import MAX_EVENT_BYTES, TRAP_COMMENT, EventTooLarge, SseRelay
from gateway.types import Clock, Send
from gateway.upstream import IdleTimeout, UpstreamError, UpstreamResponse

FORWARDED_MESSAGE_LIMIT = 4096
# A non-streaming answer is held whole before it is sent (its length goes first); real ones are
# kilobytes, a long embedding batch some MiB.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
_CREDENTIAL = re.compile(
    r"(?i)\bbearer\s+\S+|\b(?:api[_-]?key|key|token|secret|password)=\S+|\bsk-[A-Za-z0-9_-]{8,}"
)
_URL = re.compile(r"\b(?:https?|wss?)://\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b")


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
    ex.headers_sent = True
    await send({"type": "http.response.body", "body": body})


async def send_whole(
    send: Send,
    ex: Exchange,
    response: UpstreamResponse,
    clock: Clock,
    dialect: Dialect = OPENAI,
    *,
    limit: int = MAX_ANSWER_BYTES,
    offload: int = 1024 * 1024,
) -> None:
    """A non-streaming answer: its headers come only when generation ends, so read it all (up to
    `limit`: past it the replica's answer is refused, not held), parsed on a worker thread when big."""
    data = await response.read(limit + 1)
    if len(data) > limit:
        ex.outcome, ex.error_code = "upstream_error", "upstream_answer_too_large"
        ex.upstream_errors.append("upstream_answer_too_large")
        raise UpstreamFailure(
            f"The replica's answer is larger than the gateway's limit of {limit} bytes; stream it instead",
            code="upstream_answer_too_large",
        )
    ex.status = response.status
    content_type = response.headers.get("content-type", "application/json")
    if content_type.startswith("application/json"):
        try:
            payload = (
                await asyncio.to_thread(orjson.loads, data) if len(data) > offload else orjson.loads(data)
            )
        except orjson.JSONDecodeError:
            payload = None
        if isinstance(payload, dict):
            dialect.read_whole(ex.answer, payload)
    headers = [
        (b"content-type", content_type.encode("latin-1")),
        (b"content-length", str(len(data)).encode()),
        *gateway_headers(ex),
        *_answer_headers(ex),
    ]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    ex.headers_sent = True
    await send({"type": "http.response.body", "body": data})
    ex.finished = clock()


class StallGuard:
    """Cuts off a client that stopped reading: one timer per stream, not one per chunk.

    A slow reader pauses the gateway's sends (uvicorn's flow control), which pauses reads from the
    replica (TCP backpressure); past `timeout` without progress both sides are closed, so the
    replica's slot is not held for a client that is gone in all but name.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.sending_since: float | None = None
        self.stalled = False
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(timeout / 2, self._check)

    def _check(self) -> None:
        since = self.sending_since
        if since is not None and self._loop.time() - since >= self.timeout and self._task is not None:
            self.stalled = True
            self._task.cancel()
            return
        self._timer = self._loop.call_later(self.timeout / 2, self._check)

    def close(self) -> None:
        self._timer.cancel()


async def send_stream(
    send: Send,
    ex: Exchange,
    response: UpstreamResponse,
    *,
    drop_usage: bool,
    write_timeout: float,
    clock: Clock,
    progress: Callable[[float], None] | None = None,
    dialect: Dialect = OPENAI,
    max_event: int = MAX_EVENT_BYTES,
) -> None:
    relay = SseRelay(ex.answer, drop_usage=drop_usage, clock=clock, dialect=dialect, max_event=max_event)
    ex.status = response.status
    opened, ex.stream_opened = ex.stream_opened, False  # from here the replica's stream is relayed
    if opened:
        # The headers left before a replica was chosen: its name follows as a comment instead.
        await send(
            {
                "type": "http.response.body",
                "body": b": replica %s\n\n" % ex.replica.encode(),
                "more_body": True,
            }
        )
    else:
        content_type = response.headers.get("content-type", "text/event-stream").encode("latin-1")
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": stream_head(ex, content_type),
            }
        )
        ex.headers_sent = True
    failure: str | None = None
    guard = StallGuard(write_timeout)
    loop = asyncio.get_running_loop()
    try:
        # The caller's deadline covers this too: past it, this is cancelled and the caller says so.
        async for chunk in response.chunks():
            out = relay.feed(chunk)
            if out:
                if ex.first_token is None and relay.first_token_at is not None:
                    ex.first_token = relay.first_token_at
                guard.sending_since = loop.time()
                await send({"type": "http.response.body", "body": out, "more_body": True})
                guard.sending_since = None
                if progress is not None:
                    progress(clock())
        tail = relay.flush()
        if tail:
            await send({"type": "http.response.body", "body": tail, "more_body": True})
    except asyncio.CancelledError:
        if not guard.stalled:
            raise
        # Not finishing the response makes uvicorn close the client's connection; the caller's
        # cleanup closes the replica's.
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        ex.outcome, ex.error_code, ex.disconnect_phase = "client_disconnected", "write_timeout", "write_stall"
        return
    except IdleTimeout:
        failure = "upstream_idle_timeout"
    except EventTooLarge as error:
        failure = error.kind
    except UpstreamError:
        failure = "upstream_disconnected"
    finally:
        guard.close()
    if ex.first_token is None and relay.first_token_at is not None:
        ex.first_token = relay.first_token_at
    if failure is not None:
        # Whatever partial event is held back is dropped, never glued to the error.
        ex.outcome, ex.error_code = "upstream_error", failure
        ex.upstream_errors.append(failure)
        message = f"The replica's answer broke off ({failure.replace('_', ' ')}); request {ex.request_id}"
        event = dialect.stream_error(message[:MAX_MESSAGE], failure)
        await send({"type": "http.response.body", "body": event, "more_body": True})
    elif ex.answer.thinking_trap and not relay.warned:
        # A stream that ended without [DONE]: the warning still goes last.
        await send({"type": "http.response.body", "body": TRAP_COMMENT, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
    ex.finished = clock()


def stream_head(ex: Exchange, content_type: bytes = b"text/event-stream") -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", content_type),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        *gateway_headers(ex),
    ]


async def loading_comment(send: Send, ex: Exchange, preset: str, seconds: float) -> None:
    """While a launched replica starts: open the stream (once) and say so in an SSE comment, which
    every client's parser skips; the replica's events follow on the same stream."""
    if not ex.headers_sent:
        await send({"type": "http.response.start", "status": 200, "headers": stream_head(ex)})
        ex.headers_sent = ex.stream_opened = True
        ex.status = 200
    comment = f": loading {preset}, {seconds:.0f} s\n\n".encode()
    await send({"type": "http.response.body", "body": comment, "more_body": True})


async def comment(send: Send, text: str) -> None:
    """An SSE comment on a stream the gateway opened itself (every client's parser skips it)."""
    await send({"type": "http.response.body", "body": f": {text}\n\n".encode(), "more_body": True})


async def end_stream(send: Send, ex: Exchange, message: str, code: str, dialect: Dialect = OPENAI) -> None:
    """End a stream the gateway itself must stop (shutdown): one error event, no [DONE]."""
    ex.error_code = code
    event = dialect.stream_error(message[:MAX_MESSAGE], code)
    await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _answer_headers(ex: Exchange) -> list[tuple[bytes, bytes]]:
    headers = []
    answer = ex.answer
    if answer.cached_tokens is not None:
        headers.append((b"x-gateway-cached-tokens", str(answer.cached_tokens).encode()))
    if answer.thinking_trap:
        headers.append((b"x-gateway-warning", TRAP_WARNING.encode()))
    return headers


def upstream_error(
    status: int, raw: bytes, secrets: tuple[str, ...] = (), dialect: Dialect = OPENAI
) -> tuple[str, str, str | int, str | None]:
    """A replica's 4xx as (message, type, code, param): its message scrubbed and bounded. Either
    engine may answer in either envelope."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = None
    message, type_, code, param = dialect.error_message(payload)
    if not message and dialect is not OPENAI:
        message, type_, code, param = OPENAI.error_message(payload)
    if type_ is None or len(type_) > 64:
        type_ = "invalid_request_error"
    message = scrub(message, secrets)[:FORWARDED_MESSAGE_LIMIT] or f"The replica answered {status}"
    return message, type_, status if code is None else code, param


def upstream_error_body(
    status: int, raw: bytes, request_id: str, secrets: tuple[str, ...] = (), dialect: Dialect = OPENAI
) -> bytes:
    """A replica's 4xx keeps its status and message (scrubbed, bounded), in the client's own
    dialect's envelope."""
    message, type_, code, param = upstream_error(status, raw, secrets, dialect)
    return dialect.error_body(status, type_, message, code, param)


def scrub(message: str, secrets: tuple[str, ...] = ()) -> str:
    """A replica's message may echo its address or its key: neither reaches the client."""
    for secret in secrets:
        if secret:
            message = message.replace(secret, "[redacted]")
    return _URL.sub("[address]", _CREDENTIAL.sub("[redacted]", message))
