"""Gateway API keys, as plain ASGI middleware in front of everything but the health endpoints.

A key is accepted as `Authorization: Bearer <key>` (OpenAI SDKs, Codex) or `x-api-key: <key>`
(Anthropic SDKs, Claude Code with ANTHROPIC_API_KEY). The decision reads `scope["path"]`, never a
URL rebuilt from the Host header: both HTTP parsers accept `Host: localhost/v1/models?`, which is
how vLLM's own check was bypassed (GHSA-94f4-hr76-p5j6).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from gateway.edge.reject import Recorder, reject
from gateway.errors import Unauthorized
from gateway.team.keys import ANONYMOUS, OPEN, Keyring
from gateway.types import ASGIApp, Receive, Scope, Send

# The status page itself holds no data (it asks for the key and sends it with /ui/state).
# `/` answers Claude Code's HEAD probe, which it sends without a key.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/ui", "/"})


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
    """Names the caller: `scope["gateway.identity"]` is its key's identity (team/keys.py), or the
    anonymous one of an open gateway. The keyring is read per request, so a reload applies at once."""

    def __init__(
        self,
        app: ASGIApp,
        keyring: Callable[[], Keyring],
        record: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.keyring = keyring
        self.record = record
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keyring = self.keyring()
        if scope["type"] != "http" or not keyring or scope["path"] in PUBLIC_PATHS:
            if scope["type"] == "http":
                scope["gateway.identity"] = OPEN
            await self.app(scope, receive, send)
            return
        token = presented_key(scope)
        identity = keyring.identify(token) if token is not None else None
        if token is not None and identity is not None:
            scope["gateway.identity"] = identity
            # Who the client is, for per-client figures (prefix churn), without keeping the key.
            scope["gateway.client"] = (
                "key:" + hashlib.sha256(token.encode()).hexdigest()[:8]
                if identity.name == ANONYMOUS
                else f"key:{identity.name}"
            )
            await self.app(scope, receive, send)
            return
        message = "Missing API key" if token is None else "Invalid API key"
        error = Unauthorized(f"{message}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        await reject(scope, send, error, self.record, self.clock())
