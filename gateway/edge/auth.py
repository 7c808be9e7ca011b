"""Gateway API keys, as plain ASGI middleware in front of everything but the health endpoints.

The decision reads `scope["path"]`, never a URL rebuilt from the Host header: both HTTP parsers
accept `Host: localhost/v1/models?`, which is how vLLM's own check was bypassed (GHSA-94f4-hr76-p5j6).
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from typing import Any

from gateway.errors import Unauthorized
from gateway.ops.exchange import Exchange
from gateway.relay.respond import send_error
from gateway.types import ASGIApp, Scope

# The status page itself holds no data (it asks for the key and sends it with /ui/state).
PUBLIC_PATHS = frozenset({"/health", "/ready", "/ui"})


def key_matches(presented: str, keys: frozenset[str]) -> bool:
    # Every key is compared, in constant time each, so neither a match's position nor its
    # prefix can be timed.
    candidate = presented.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(candidate, key.encode())
    return found


def bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class KeyAuth:
    def __init__(self, app: ASGIApp, keys: frozenset[str]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer(scope)
        if token is not None and key_matches(token, self.keys):
            # Who the client is, for per-client figures (prefix churn), without keeping the key.
            scope["gateway.client"] = "key:" + hashlib.sha256(token.encode()).hexdigest()[:8]
            await self.app(scope, receive, send)
            return
        message = "Missing API key" if token is None else "Invalid API key"
        ex = Exchange(request_id=uuid.uuid4().hex, endpoint="auth", started=0.0)
        await send_error(send, ex, Unauthorized(f"{message}: send 'Authorization: Bearer <key>'"))
