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

from gateway.answer import TRAP_WARNING, Answer

_BOUNDARIES = (b"\n\n", b"\r\n\r\n", b"\r\r")
_SPLIT = re.compile(rb"(\r\n\r\n|\n\n|\r\r)")
_CONTENT = re.compile(rb'"(?:content|text)":\s*"(?!")|"tool_calls":\s*\[\s*\{')
_REASONING = re.compile(rb'"reasoning(?:_content)?":\s*"(?!")')
# Plain substring tests, far cheaper than a regex scan of every block, in the compact spelling both
# engines emit. A finish reason that is not null, and usage (llama-server's timings come with it,
# and the gateway asks for usage on every stream).
_MARKERS = (b'"finish_reason":"', b'"usage"')
_DONE = b"data: [DONE]"
# The thinking trap is known only at the end of a stream, long after the headers left. An SSE
# comment is ignored by clients' parsers but seen in the raw stream; it goes before [DONE], since
# most clients stop reading there.
TRAP_COMMENT = b": gateway-warning: " + TRAP_WARNING.encode() + b"\n\n"


class SseRelay:
    def __init__(self, answer: Answer, drop_usage: bool, clock: Callable[[], float]) -> None:
        self.answer = answer
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
            return self._inspect(chunk[:end]) if end else b""
        # Search only the new bytes (and the 3 before, for a boundary split across reads):
        # an event that arrives one byte at a time must not cost quadratic time.
        start = max(0, len(self._pending) - 3)
        self._pending += chunk
        end = _last_boundary(self._pending, start)
        if end == 0:
            return b""
        block = bytes(self._pending[:end])
        del self._pending[:end]
        return self._inspect(block)

    def flush(self) -> bytes:
        """At a clean end of stream: whatever remains, even without its final blank line."""
        rest = bytes(self._pending)
        self._pending.clear()
        return self._inspect(rest) if rest else b""

    def _inspect(self, block: bytes) -> bytes:
        out = self._pass(block)
        # finish_reason first: one attribute test per block on the hot path.
        if self.answer.finish_reason == "length" and not self.warned and self.answer.thinking_trap:
            done = out.find(_DONE)
            if done >= 0:
                self.warned = True
                return out[:done] + TRAP_COMMENT + out[done:]
        return out

    def _pass(self, block: bytes) -> bytes:
        answer = self.answer
        if not answer.content_seen:
            # Reasoning only matters until an answer appears (the first token; the thinking trap).
            if _CONTENT.search(block):
                answer.content_seen = True
            elif not answer.reasoning_seen and _REASONING.search(block):
                answer.reasoning_seen = True
            if self.first_token_at is None and (answer.content_seen or answer.reasoning_seen):
                self.first_token_at = self._clock()
        if not _worth_parsing(block):
            return block
        # Reads often hold many events at once; only the few that carry a finish reason or usage
        # are parsed, the rest pass as they are.
        pieces = _SPLIT.split(block)
        kept: list[bytes] = []
        for index in range(0, len(pieces), 2):
            event = pieces[index]
            separator = pieces[index + 1] if index + 1 < len(pieces) else b""
            if _worth_parsing(event):
                payload = _data(event)
                if payload is not None:
                    answer.read_chunk(payload)
                    if self.drop_usage and payload.get("choices") == [] and "usage" in payload:
                        continue
            kept.append(event + separator)
        return b"".join(kept)


def _worth_parsing(data: bytes) -> bool:
    # Two plain tests; a generator for any() costs more than the tests on short blocks.
    return _MARKERS[0] in data or _MARKERS[1] in data


def _last_boundary(data: bytes | bytearray, start: int) -> int:
    """The end of the last complete event in data[start:] (0 when there is none)."""
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
