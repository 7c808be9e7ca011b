"""Names shared across the gateway, defined once: the ASGI callables, a clock, a JSON object, a body
as read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Clock = Callable[[], float]  # seconds, monotonic unless a test injects its own
Json = dict[str, Any]  # a parsed JSON object
# A body as an upstream client read it: gathered in a bytearray where it may be large, so that it is
# not held twice (its pieces and their join) at its peak; every reader takes either.
ReadBytes = bytes | bytearray


def header_map(scope: Scope) -> dict[str, str]:
    """A request's headers by lower-case name (the last of a repeated one), as text."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
