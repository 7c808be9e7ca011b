"""Limits checked on every request before anything else reads it.

httptools accepts request headers of any size (a 20 MB header was measured here), so the limits
Envoy applies at its edge (60 KiB, 100 fields) are enforced in the first ASGI layer instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.edge.reject import Recorder, reject
from gateway.errors import HeadersTooLarge
from gateway.types import ASGIApp, Receive, Scope, Send


class HeaderLimits:
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
            headers = scope["headers"]
            if len(headers) > self.max_count or sum(len(k) + len(v) for k, v in headers) > self.max_bytes:
                error = HeadersTooLarge(
                    f"Request headers exceed the limit of {self.max_count} fields or {self.max_bytes} bytes"
                )
                await reject(scope, send, error, self.record, self.clock())
                return
        await self.app(scope, receive, send)
