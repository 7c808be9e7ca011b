"""A non-streaming answer relayed whole: its headers come only when generation ends, so it is read
to its end (up to a limit: past it the replica's answer is refused, not held), what it says about
itself is read into the record, and it goes to the client with its length.

Where the gateway asked the engine for a stream instead (answers/assemble.py says why), the events
are read as they come (the record gets its first token and usage as for any stream) and the whole
answer is assembled from them; a client that leaves meanwhile stops the engine at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from gateway.answers.assemble import Assembler
from gateway.answers.changes import Changes
from gateway.answers.events import parse
from gateway.dialects.answer import TRAP_WARNING
from gateway.errors import UpstreamFailure
from gateway.ops.exchange import Exchange
from gateway.relay.respond import Responder, gateway_headers
from gateway.relay.sse import SseRelay
from gateway.types import ReadBytes
from gateway.upstream import UpstreamResponse

# A non-streaming answer is held whole before it is sent (its length goes first); real ones are
# kilobytes, a long embedding batch some MiB.
MAX_ANSWER_BYTES = 64 * 1024 * 1024


async def relay_whole(
    responder: Responder,
    response: UpstreamResponse,
    *,
    changes: Changes,
    limit: int = MAX_ANSWER_BYTES,
    offload: int = 1024 * 1024,
) -> None:
    """Read the replica's whole answer (parsed on a worker thread when big), apply the request's
    changes to it, and send it."""
    ex = responder.ex
    data = await response.read(limit + 1)
    if len(data) > limit:
        ex.outcome, ex.error_code = "upstream_error", "upstream_answer_too_large"
        ex.upstream_errors.append("upstream_answer_too_large")
        raise UpstreamFailure(
            f"The replica's answer is larger than the gateway's limit of {limit} bytes; stream it instead",
            code="upstream_answer_too_large",
        )
    content_type = response.headers.get("content-type", "application/json")
    if content_type.startswith("application/json"):
        if len(data) > offload and not changes:
            # A large answer (an embedding batch) is not parsed whole: its Python objects would take
            # several times its bytes. What the record needs, its usage, sits near its end.
            payload = _tail_usage(data)
        else:
            try:
                payload = (
                    await asyncio.to_thread(orjson.loads, data) if len(data) > offload else orjson.loads(data)
                )
            except orjson.JSONDecodeError:
                payload = None
        if isinstance(payload, dict):
            responder.dialect.read_whole(ex.answer, payload)
            if changes:
                data = orjson.dumps(changes.whole(payload))
    await _send(responder, response.status, content_type, data)


_TAIL = 64 * 1024


def _tail_usage(data: ReadBytes) -> dict[str, Any] | None:
    """The answer's `usage` object, read from its last bytes (every engine writes it last or near
    the end), as a payload the dialects read usage from; None when it is not there."""
    tail = bytes(data[-_TAIL:])
    at = tail.rfind(b'"usage"')
    start = tail.find(b"{", at) if at >= 0 else -1
    if start < 0:
        return None
    depth, quoted, escaped = 0, False, False
    for index in range(start, len(tail)):
        char = tail[index]
        if quoted:
            if escaped:
                escaped = False
            elif char == 0x5C:  # a backslash escapes what follows
                escaped = True
            elif char == 0x22:  # the closing quote
                quoted = False
            continue
        if char == 0x22:
            quoted = True
        elif char == 0x7B:
            depth += 1
        elif char == 0x7D:
            depth -= 1
            if depth == 0:
                try:
                    usage = orjson.loads(tail[start : index + 1])
                except orjson.JSONDecodeError:
                    return None
                return {"usage": usage} if isinstance(usage, dict) else None
    return None


async def relay_assembled(
    responder: Responder,
    response: UpstreamResponse,
    assembler: Assembler,
    changes: Changes,
    *,
    limit: int = MAX_ANSWER_BYTES,
) -> None:
    """A stream the engine sent for a client that wants the whole answer: assembled, then sent."""
    ex = responder.ex
    relay = SseRelay(ex.answer, drop_usage=False, clock=responder.clock, dialect=responder.dialect)
    size = 0
    async for chunk in response.chunks():
        size += len(chunk)
        if size > limit:
            ex.outcome, ex.error_code = "upstream_error", "upstream_answer_too_large"
            ex.upstream_errors.append("upstream_answer_too_large")
            raise UpstreamFailure(
                f"The replica's answer is larger than the gateway's limit of {limit} bytes",
                code="upstream_answer_too_large",
            )
        _assemble(relay.feed(chunk), assembler, ex)
        if ex.first_token is None and relay.first_token_at is not None:
            ex.first_token = relay.first_token_at
    _assemble(relay.flush(), assembler, ex)
    payload = assembler.result()
    if changes:
        payload = changes.whole(payload)
    await _send(responder, 200, "application/json", orjson.dumps(payload))


def _assemble(block: bytes, assembler: Assembler, ex: Exchange) -> None:
    for event in parse(block) if block else ():
        error = event.data.get("error") if event.data is not None else None
        if error is not None:
            # An engine's error in the middle of its stream: nothing reached the client yet, so it
            # is a failed answer, not a partial one.
            ex.outcome, ex.error_code = "upstream_error", "upstream_stream_error"
            raise UpstreamFailure(_message(error), code="upstream_stream_error")
        assembler.feed(event)


def _message(error: Any) -> str:
    text = error.get("message") if isinstance(error, dict) else error
    return f"The replica failed while answering: {str(text)[:300]}"


async def _send(responder: Responder, status: int, content_type: str, data: ReadBytes) -> None:
    ex = responder.ex
    headers = [
        (b"content-type", content_type.encode("latin-1")),
        (b"content-length", str(len(data)).encode()),
        *gateway_headers(ex),
        *answer_headers(ex),
    ]
    await responder.start(status, headers)
    await responder.body(data, more=False)
    ex.finished = responder.clock()


def answer_headers(ex: Exchange) -> list[tuple[bytes, bytes]]:
    headers = []
    answer = ex.answer
    if answer.cached_tokens is not None:
        headers.append((b"x-gateway-cached-tokens", str(answer.cached_tokens).encode()))
    if answer.thinking_trap:
        headers.append((b"x-gateway-warning", TRAP_WARNING.encode()))
    return headers
