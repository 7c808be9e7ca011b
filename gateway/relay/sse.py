"""Server-sent events relayed as raw bytes, cut only at event boundaries.

Bytes are forwarded as they arrive, up to the last complete event; an incomplete event is held
until its blank line arrives. So if the replica dies mid-event the gateway can end the stream with
one clean error event and never glue a half event to it (sub2api #1471). Only the few events that
metrics need (finish reason, usage) are parsed; the rest is matched with a cheap byte search.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import orjson

from gateway.dialects.answer import TRAP_WARNING, Answer
from gateway.dialects.base import Dialect
from gateway.dialects.openai import OPENAI
from gateway.upstream import UpstreamError

_BOUNDARIES = (b"\n\n", b"\r\n\r\n", b"\r\r")
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
# The thinking trap is known only at the end of a stream, long after the headers left. An SSE
# comment is ignored by clients' parsers but seen in the raw stream; it goes before [DONE], since
# most clients stop reading there.
TRAP_COMMENT = b": gateway-warning: " + TRAP_WARNING.encode() + b"\n\n"
# One event held back until its blank line: the biggest real ones are a tool call's arguments or a
# whole answer in one event (kilobytes to a few MiB). Past this the stream ends with the error event.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class EventTooLarge(UpstreamError):
    kind = "upstream_event_too_large"


class SseRelay:
    def __init__(
        self,
        answer: Answer,
        drop_usage: bool,
        clock: Callable[[], float],
        dialect: Dialect = OPENAI,
        max_event: int = MAX_EVENT_BYTES,
    ) -> None:
        self.answer = answer
        self.max_event = max_event
        self.dialect = dialect
        # Plain substring tests, far cheaper than a regex scan of every block, in the compact
        # spelling both engines emit: the few events that carry usage or the answer's end.
        self.markers = dialect.markers
        self.drop_usage = drop_usage  # the gateway asked for usage; the client did not
        self.first_token_at: float | None = None
        self._clock = clock
        self._pending = bytearray()
        self.warned = False  # the thinking-trap comment went out

    @property
    def pending(self) -> bytes:
        return bytes(self._pending)

    def feed(self, chunk: bytes) -> bytes:
        """Return the complete events now available, to forward as they are."""
        if not self._pending:
            end = _last_boundary(chunk, 0)
            if end == len(chunk):
                return self._inspect(chunk)  # the usual case: whole events, no copy
            self._pending += chunk[end:]
            self._bound()
            return self._inspect(chunk[:end]) if end else b""
        # Search only the new bytes (and the 3 before, for a boundary split across reads):
        # an event that arrives one byte at a time must not cost quadratic time.
        start = max(0, len(self._pending) - 3)
        self._pending += chunk
        end = _last_boundary(self._pending, start)
        if end == 0:
            self._bound()
            return b""
        block = bytes(self._pending[:end])
        del self._pending[:end]
        return self._inspect(block)

    def _bound(self) -> None:
        if len(self._pending) > self.max_event:
            self._pending.clear()
            raise EventTooLarge

    def flush(self) -> bytes:
        """At a clean end of stream: whatever remains, even without its final blank line."""
        rest = bytes(self._pending)
        self._pending.clear()
        return self._inspect(rest) if rest else b""

    def _inspect(self, block: bytes) -> bytes:
        out = self._pass(block)
        # finish_reason first: one attribute test per block on the hot path.
        done_marker = self.dialect.done
        if (
            done_marker is not None
            and self.answer.finish_reason == "length"
            and not self.warned
            and self.answer.thinking_trap
        ):
            done = out.find(done_marker)
            if done >= 0:
                self.warned = True
                return out[:done] + TRAP_COMMENT + out[done:]
        return out

    def _pass(self, block: bytes) -> bytes:
        answer = self.answer
        answer.events += block.count(b"data:")
        if not answer.content_seen:
            # Reasoning only matters until an answer appears (the first token; the thinking trap).
            if self.dialect.content.search(block):
                answer.content_seen = True
            elif not answer.reasoning_seen and self.dialect.reasoning.search(block):
                answer.reasoning_seen = True
            if self.first_token_at is None and (answer.content_seen or answer.reasoning_seen):
                self.first_token_at = self._clock()
        markers = self.markers
        for marker in markers:
            if marker in block:
                break
        else:
            return block  # the usual read: no event that carries usage or the answer's end
        found = [block.find(marker) for marker in markers]
        # Reads often hold many events at once (64 after a stall): only the one or two that carry
        # usage or the answer's end are cut out and parsed; the bytes around them pass as they are.
        dialect = self.dialect
        kept: list[bytes] = []
        copied = 0  # block[:copied] is in `kept` or dropped
        after = 0
        while True:
            live = [at for at in found if at >= 0]
            if not live:
                break
            start, end, after = _event_around(block, min(live), after)
            payload = _data(block[start:end])
            if payload is not None:
                dialect.read_event(answer, payload)
                if self.drop_usage and dialect.injected_usage(payload):
                    kept.append(block[copied:start])
                    copied = after
            # Each marker is searched for again only once passed: one scan of the block for each.
            found = [
                block.find(m, after) if 0 <= at < after else at for m, at in zip(markers, found, strict=True)
            ]
        if not copied:
            return block
        kept.append(block[copied:])
        return b"".join(kept)


def _event_around(data: bytes, at: int, lo: int) -> tuple[int, int, int]:
    """The event holding data[at], which starts at `lo` or later: (its start, its end, the end of
    the blank line after it). Both searches stop at the event's edges, so a read full of marked
    events (vLLM's continuous usage) costs linear time."""
    start = lo
    for boundary in _BOUNDARIES:
        found = data.rfind(boundary, lo, at)
        if found >= 0:
            start = max(start, found + len(boundary))
    blank = _BOUNDARY.search(data, at)
    if blank is None:
        return start, len(data), len(data)
    return start, blank.start(), blank.end()


def _last_boundary(data: bytes | bytearray, start: int) -> int:
    """The end of the last complete event in data[start:] (0 when there is none)."""
    if data.endswith(b"\n\n") or data.endswith(b"\r\r"):  # the usual read: whole events
        return len(data)
    best = 0
    for boundary in _BOUNDARIES:
        at = data.rfind(boundary, start)
        if at >= 0:
            best = max(best, at + len(boundary))
    return best


def _data(event: bytes) -> dict[str, object] | None:
    lines = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    raw = b"\n".join(lines)
    if not raw.startswith(b"{"):
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
