"""Gateway API keys, as plain ASGI middleware in front of everything but the health endpoints.

A key is accepted as `Authorization: Bearer <key>` (OpenAI SDKs, Codex) or `x-api-key: <key>`
(Anthropic SDKs, Claude Code with ANTHROPIC_API_KEY). The decision reads `scope["path"]`, never a
URL rebuilt from the Host header: both HTTP parsers accept `Host: localhost/v1/models?`, which is
how vLLM's own check was bypassed (GHSA-94f4-hr76-p5j6).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

from gateway.edge.reject import Recorder, reject
from gateway.errors import Unauthorized
from gateway.types import ASGIApp, Receive, Scope, Send

# The status page itself holds no data (it asks for the key and sends it with /ui/state).
# `/` answers Claude Code's HEAD probe, which it sends without a key.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/ui", "/"})


def key_matches(presented: str, keys: frozenset[str]) -> bool:
    # Every key is compared, in constant time each, so neither a match's position nor its
    # prefix can be timed.
    candidate = presented.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(candidate, key.encode())
    return found


def presented_key(scope: Scope) -> str | None:
    """The key as the client sent it: a bearer token, else `x-api-key`."""
    api_key: str | None = None
    for name, value in scope["headers"]:
        text: str = value.decode("latin-1")
        if name == b"authorization":
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and text.strip():
            api_key = text.strip()
    return api_key


class KeyAuth:
    def __init__(
        self,
        app: ASGIApp,
        keys: frozenset[str],
        record: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.keys = keys
        self.record = record
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        token = presented_key(scope)
        if token is not None and key_matches(token, self.keys):
            # Who the client is, for per-client figures (prefix churn), without keeping the key.
            scope["gateway.client"] = "key:" + hashlib.sha256(token.encode()).hexdigest()[:8]
            await self.app(scope, receive, send)
            return
        message = "Missing API key" if token is None else "Invalid API key"
        error = Unauthorized(f"{message}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        await reject(scope, send, error, self.record, self.clock())
