"""A stream the gateway opened itself (to keep a waiting client connected) spliced onto the
replica's: the replica's own opening events are dropped, since the client already had the
gateway's (a second `message_start` or `response.created` would start a second answer).

What only the dropped opening said is not lost: a Messages `message_start` is the one event that
carries the prompt's cache figures (`cache_read_input_tokens`, ...), which Claude Code shows and
counts; they go to the client in the answer's `message_delta` usage instead, where the Messages
API also reports them."""

from __future__ import annotations

from typing import Any

from gateway.answers.changes import Change
from gateway.answers.events import Event

# The prompt's figures a Messages `message_start` reports and a `message_delta` may carry too.
CARRIED = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


class Splice(Change):
    """Drops the replica's opening events; then, where one held the prompt's cache figures, adds
    them to the answer's `message_delta`; everything else passes untouched."""

    name = "splice"

    def __init__(self, opening: frozenset[str]) -> None:
        self.opening = opening
        self.done = not opening
        self.opened = False  # the replica's answer itself has begun
        self.carried: dict[str, Any] = {}

    def stream(self, event: Event) -> list[Event]:
        if self.done:
            return [event]
        if not self.opened:
            if event.kind in self.opening:
                self._keep(event)
                return []
            if event.data is not None:
                self.opened = True  # the first event of the answer itself
                self.done = not self.carried
                if self.carried:
                    self.markers = (b"message_delta",)  # only that event is parsed from here
            return [event]
        if event.kind == "message_delta" and event.data is not None:
            usage = event.data.get("usage")
            if isinstance(usage, dict):
                missing = {k: v for k, v in self.carried.items() if k not in usage}
                if missing:
                    event.data["usage"] = {**usage, **missing}
                    event.changed()
            self.done = True
        return [event]

    def _keep(self, event: Event) -> None:
        message = event.data.get("message") if event.data is not None else None
        usage = message.get("usage") if isinstance(message, dict) else None
        if isinstance(usage, dict):
            self.carried = {k: usage[k] for k in CARRIED if isinstance(usage.get(k), int)}
