"""Limits checked on every request before anything else reads it.

httptools accepts request headers of any size (a 20 MB header was measured here), so the limits
Envoy applies at its edge (60 KiB, 100 fields) are enforced in the first ASGI layer instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.edge.reject import Recorder, reject
from gateway.errors import GatewayError, HeadersTooLarge
from gateway.types import ASGIApp, Receive, Scope, Send


def headers_error(headers: list[tuple[bytes, bytes]], max_bytes: int, max_count: int) -> GatewayError | None:
    """The refusal of a head past the field or byte limit, or None."""
    if len(headers) > max_count or sum(len(k) + len(v) for k, v in headers) > max_bytes:
        return HeadersTooLarge(f"Request headers exceed the limit of {max_count} fields or {max_bytes} bytes")
    return None


class HeaderLimits:
    """The limits as ASGI middleware, for an app without the gateway's own edge (edge/door.py)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_count: int,
        record: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.record = record
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = headers_error(scope["headers"], self.max_bytes, self.max_count)
            if error is not None:
                await reject(scope, send, error, self.record, self.clock())
                return
        await self.app(scope, receive, send)
