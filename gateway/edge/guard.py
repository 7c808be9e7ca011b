"""Limits checked on every request before anything else reads it.

httptools accepts request headers of any size (a 20 MB header was measured here), so the limits
Envoy applies at its edge (60 KiB, 100 fields) are enforced in the first ASGI layer instead.
"""

from __future__ import annotations

import uuid
from typing import Any

from gateway.errors import GatewayError
from gateway.ops.exchange import Exchange
from gateway.relay.respond import send_error


class HeadersTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    default_code = "headers_too_large"


class HeaderLimits:
    def __init__(self, app: Any, max_bytes: int, max_count: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_count = max_count

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            if len(headers) > self.max_count or sum(len(k) + len(v) for k, v in headers) > self.max_bytes:
                ex = Exchange(request_id=uuid.uuid4().hex, endpoint="guard", started=0.0)
                error = HeadersTooLarge(
                    f"Request headers exceed the limit of {self.max_count} fields or {self.max_bytes} bytes"
                )
                await send_error(send, ex, error)
                return
        await self.app(scope, receive, send)
