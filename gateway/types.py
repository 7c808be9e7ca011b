"""Names shared across the gateway, defined once: the ASGI callables, a clock, a JSON object."""

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


def header_map(scope: Scope) -> dict[str, str]:
    """A request's headers by lower-case name (the last of a repeated one), as text."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
