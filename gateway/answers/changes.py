"""The changes one request makes to its answer: pure objects, built by the rewrite step (which
knows what it changed in the request: a custom tool sent as a function, a tool group flattened)
and applied by the relay, to a stream event by event or to a whole answer.

An empty `Changes` is the common case, and then the relay never parses an event: the answer passes
as the replica's bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.answers.events import Event


class Change:
    """One change to an answer in one dialect. A stream change may hold events back (and return
    them later, or at `end`); a whole-answer change returns the payload to send."""

    name = "change"
    done = False  # nothing more to change: the rest of the stream may pass as bytes
    # The byte strings an event must hold for this change to care about it (None: every event);
    # a block of events with none of them, while the change is not `engaged`, is not parsed. Each
    # subclass that sets its own names this type again: a compiled class (mypyc) keeps the type an
    # attribute was declared with, and a bare tuple would declare a narrower one.
    markers: tuple[bytes, ...] | None = None

    @property
    def engaged(self) -> bool:
        """Whether the change holds state that every following event must pass through."""
        return False

    def stream(self, event: Event) -> list[Event]:
        return [event]

    def end(self) -> list[Event]:
        return []

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        return payload


class Changes:
    """A request's changes, applied in order: what one returns is what the next one sees."""

    __slots__ = ("items",)

    def __init__(self, items: Iterable[Change] = ()) -> None:
        self.items = list(items)

    def __bool__(self) -> bool:
        """Whether any change is still at work (the relay parses events only while one is)."""
        return any(not item.done for item in self.items)

    def wants(self, block: bytes) -> bool:
        """Whether a block of whole events must be parsed for these changes: most of an agent's
        stream (text deltas) holds no tool call, and passes as the replica's bytes."""
        for item in self.items:
            if item.done:
                continue
            if item.markers is None or item.engaged or any(m in block for m in item.markers):
                return True
        return False

    def add(self, change: Change) -> None:
        self.items.append(change)

    def stream(self, events: list[Event]) -> list[Event]:
        for change in self.items:
            out: list[Event] = []
            for event in events:
                out.extend(change.stream(event))
            events = out
        return events

    def end(self) -> list[Event]:
        """At the end of the stream: what each change still holds, through the changes after it."""
        out: list[Event] = []
        for change in self.items:
            passed: list[Event] = []
            for event in out:
                passed.extend(change.stream(event))
            passed.extend(change.end())
            out = passed
        return out

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        for change in self.items:
            payload = change.whole(payload)
        return payload
