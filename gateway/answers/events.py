"""Server-sent events as values, for the answers the gateway has to change on their way.

Most answers pass through the relay as raw bytes (relay/sse.py). When a change is needed (a tool
call repaired, a custom tool's call renamed, a stream the gateway opened itself spliced onto the
replica's), the relay cuts the stream into `Event`s, hands them to the request's `Changes`
(changes.py) and writes what comes back. An event keeps the bytes it came with until someone
changes it, so an unchanged event goes out exactly as the replica sent it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass
class Event:
    """One SSE event: its `event:` name (Messages and Responses name theirs; chat does not), its
    JSON payload, or `raw` bytes for what is not JSON (`[DONE]`, comments)."""

    name: str | None = None
    data: dict[str, Any] | None = None
    raw: bytes | None = None  # the event as it came, while unchanged

    @property
    def kind(self) -> str | None:
        """The payload's own `type` (Messages, Responses), else the event name."""
        if self.data is not None and isinstance(self.data.get("type"), str):
            return str(self.data["type"])
        return self.name

    def changed(self) -> Event:
        """Marks the event as changed: it is serialised again from its payload."""
        self.raw = None
        return self

    def encode(self) -> bytes:
        if self.raw is not None:
            return self.raw
        lines = b""
        if self.name is not None:
            lines += b"event: " + self.name.encode() + b"\n"
        payload = orjson.dumps(self.data) if self.data is not None else b""
        return lines + b"data: " + payload + b"\n\n"


def make(data: dict[str, Any], name: str | None = None) -> Event:
    """A new event the gateway writes itself: named after its payload's type where it has one."""
    if name is None and isinstance(data.get("type"), str):
        name = str(data["type"])
    return Event(name, data)


def parse(block: bytes) -> list[Event]:
    """The events in a block of whole events (as the SSE relay hands them on)."""
    events = []
    for chunk in _split(block):
        name: str | None = None
        data_lines = []
        for line in chunk.splitlines():
            if line.startswith(b"event:"):
                name = line[6:].strip().decode("utf-8", "replace")
            elif line.startswith(b"data:"):
                data_lines.append(line[5:].lstrip(b" "))
        raw = chunk + b"\n\n"
        payload = b"\n".join(data_lines)
        if payload.startswith(b"{"):
            try:
                value = orjson.loads(payload)
            except orjson.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                events.append(Event(name, value, raw))
                continue
        events.append(Event(name, None, raw))
    return events


def _split(block: bytes) -> list[bytes]:
    normalised = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return [chunk for chunk in normalised.split(b"\n\n") if chunk.strip()]


def encode(events: list[Event]) -> bytes:
    return b"".join(event.encode() for event in events)
