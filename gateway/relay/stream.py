"""A replica's stream relayed to the client as it arrives, cut only at event boundaries (sse.py).

A replica that breaks off, stalls past the idle timeout or sends an event past the size bound ends
the stream with the dialect's one error event (never a half event glued to it); a client that
stops reading is cut off by the stall guard, so the replica's slot is not held for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from gateway.answers.changes import Changes
from gateway.answers.events import encode, parse
from gateway.answers.splice import Splice
from gateway.caught import Caught, raise_again
from gateway.errors import MAX_MESSAGE
from gateway.relay.keepalive import KeepAlive
from gateway.relay.respond import Responder, stream_head
from gateway.relay.sse import MAX_EVENT_BYTES, TRAP_COMMENT, EventTooLarge, SseRelay
from gateway.upstream import IdleTimeout, UpstreamError, UpstreamResponse


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


async def relay_stream(
    responder: Responder,
    response: UpstreamResponse,
    *,
    drop_usage: bool,
    write_timeout: float,
    changes: Changes | None = None,
    keepalive: KeepAlive | None = None,
    progress: Callable[[float], None] | None = None,
    max_event: int = MAX_EVENT_BYTES,
) -> None:
    """Relays the replica's events as they come; with `changes`, each block of whole events is
    parsed, changed and written again (the request's changes may hold events back). With a
    `keepalive`, the client is kept connected until the replica's first event arrives."""
    ex, dialect, clock = responder.ex, responder.dialect, responder.clock
    relay = SseRelay(ex.answer, drop_usage=drop_usage, clock=clock, dialect=dialect, max_event=max_event)
    chunks = response.chunks().__aiter__()
    failure: str | None = None
    guard = StallGuard(write_timeout)
    loop = asyncio.get_running_loop()
    begun = False
    try:
        # The caller's deadline covers this too: past it, this is cancelled and the caller says so.
        first = b""
        if keepalive is not None:
            caught: Caught[BaseException] | None = None
            try:
                first = await anext(chunks, b"")
            except BaseException as error:
                caught = Caught(error)
            await keepalive.stop()
            raise_again(caught)
        changes = await _begin(responder, response, changes)
        begun = True
        # `wants` says whether a change is still at work on this block: no `bool(changes)` per read.
        changing = changes is not None and bool(changes.items)
        async for chunk in _Chained(first, chunks) if first else chunks:
            out = relay.feed(chunk)
            if out and changing and changes.wants(out):  # type: ignore[union-attr]
                out = encode(changes.stream(parse(out)))  # type: ignore[union-attr]
            if out:
                if ex.first_token is None and relay.first_token_at is not None:
                    ex.first_token = relay.first_token_at
                guard.sending_since = loop.time()
                await responder.body(out)
                guard.sending_since = None
                if progress is not None:
                    progress(clock())
        tail = relay.flush()
        if changes:
            tail = encode(changes.stream(parse(tail)) + changes.end()) if tail else encode(changes.end())
        if tail:
            await responder.body(tail)
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
    if not begun:
        await _begin(responder, response, None)
    if ex.first_token is None and relay.first_token_at is not None:
        ex.first_token = relay.first_token_at
    if failure is not None:
        # Whatever partial event is held back is dropped, never glued to the error.
        ex.outcome, ex.error_code = "upstream_error", failure
        ex.upstream_errors.append(failure)
        message = f"The replica's answer broke off ({failure.replace('_', ' ')}); request {ex.request_id}"
        await responder.body(dialect.stream_error(message[:MAX_MESSAGE], failure))
    elif ex.answer.thinking_trap and not relay.warned:
        # A stream that ended without [DONE]: the warning still goes last.
        await responder.body(TRAP_COMMENT)
    await responder.body(b"", more=False)
    ex.finished = clock()


async def _begin(responder: Responder, response: UpstreamResponse, changes: Changes | None) -> Changes | None:
    """Start the client's stream with the replica's status line, or, where the gateway opened it
    already, name the replica in a comment and drop the replica's own opening events."""
    ex = responder.ex
    if not responder.opened:
        content_type = response.headers.get("content-type", "text/event-stream").encode("latin-1")
        await responder.start(response.status, stream_head(ex, content_type))
        return changes
    await responder.body(b": replica %s\n\n" % ex.replica.encode())
    responder.opened = False  # from here the replica's stream is relayed
    if not responder.spliced:
        return changes
    return Changes([Splice(responder.dialect.opening_kinds), *(changes.items if changes else ())])


class _Chained:
    """The chunk read while deciding (the first) and then the rest. A class rather than an async
    generator, which mypyc cannot compile."""

    __slots__ = ("first", "rest")

    def __init__(self, first: bytes, rest: AsyncIterator[bytes]) -> None:
        self.first, self.rest = first, rest

    def __aiter__(self) -> _Chained:
        return self

    async def __anext__(self) -> bytes:
        if self.first:
            first, self.first = self.first, b""
            return first
        return await anext(self.rest)
