"""A stream the gateway opened itself (to keep a waiting client connected) spliced onto the
replica's: the replica's own opening events are dropped, since the client already had the
gateway's (a second `message_start` or `response.created` would start a second answer)."""

from __future__ import annotations

from gateway.answers.changes import Change
from gateway.answers.events import Event


class Splice(Change):
    """Drops the replica's opening events, then lets everything through untouched."""

    name = "splice"

    def __init__(self, opening: frozenset[str]) -> None:
        self.opening = opening
        self.done = not opening

    def stream(self, event: Event) -> list[Event]:
        if self.done:
            return [event]
        if event.kind in self.opening:
            return []
        if event.data is not None:
            self.done = True  # the first event of the answer itself
        return [event]
