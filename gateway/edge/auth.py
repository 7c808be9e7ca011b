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
from gateway.errors import GatewayError, Unauthorized
from gateway.fleet.stored import NOBODY, OPEN_OWNER, Owner
from gateway.team.keys import ANONYMOUS, OPEN, Identity, Keyring
from gateway.types import ASGIApp, Receive, Scope, Send, header_map

# The status page itself holds no data (it asks for the key and sends it with /ui/state).
# `/` answers Claude Code's HEAD probe, which it sends without a key.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/ui", "/"})


def is_admin(identity: Identity, *, open_mode: bool, anonymous_admin: bool) -> bool:
    """Who may use /admin/* and see every key's figures.

    A named key marked `admin: true`. A plain key of GATEWAY_API_KEYS only where
    GATEWAY_ANONYMOUS_ADMIN says so: such keys are handed out to people and tools, and docs/team.md
    promises a 403 to any key that is not an admin. An open gateway (no key configured at all) has
    no way to tell callers apart: whoever may use it is its local user and its admin, as before;
    what keeps a web page in the user's browser out of it is edge/browser.py.
    """
    if open_mode or identity.admin:
        return True
    return anonymous_admin and identity.name == ANONYMOUS


def presented_key(headers: dict[str, str]) -> str | None:
    """The key as the client sent it: a bearer token, else `x-api-key`."""
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    api_key = headers.get("x-api-key", "").strip()
    return api_key or None


class KeyAuth:
    """Names the caller: `scope["gateway.identity"]` is its key's identity (team/keys.py), or the
    anonymous one of an open gateway; `scope["gateway.owner"]` is whose the state it makes the
    gateway keep is (fleet/stored.py's Owner). The keyring is read per request, so a reload
    applies at once."""

    def __init__(
        self,
        app: ASGIApp,
        keyring: Callable[[], Keyring],
        record: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        anonymous_admin: bool = False,
    ) -> None:
        self.app = app
        self.keyring = keyring
        self.record = record
        self.clock = clock
        self.anonymous_admin = anonymous_admin
        # A named key's client label and owner, by name, made once per keyring rather than per
        # request (two strings and an Owner); checked against the identity the keyring returns.
        self._named: dict[str, tuple[Identity, str, Owner]] = {}
        self._named_of: Keyring | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self.identify(scope, header_map(scope)) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
        else:
            await reject(scope, send, error, self.record, self.clock())

    def identify(self, scope: Scope, headers: dict[str, str]) -> GatewayError | None:
        """Names the caller in `scope` (identity, owner, client); the refusal when it may not pass."""
        keyring = self.keyring()
        if not keyring or scope["path"] in PUBLIC_PATHS:
            scope["gateway.identity"] = OPEN
            scope["gateway.owner"] = OPEN_OWNER if not keyring else NOBODY
            return None
        token = presented_key(headers)
        identity = keyring.identify(token) if token is not None else None
        if token is None or identity is None:
            message = "Missing API key" if token is None else "Invalid API key"
            return Unauthorized(f"{message}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        scope["gateway.identity"] = identity
        admin = is_admin(identity, open_mode=False, anonymous_admin=self.anonymous_admin)
        if identity.name == ANONYMOUS:
            # Plain keys share one identity; what they keep stays each key's own.
            digest = hashlib.sha256(token.encode()).hexdigest()
            # Who the client is, for per-client figures (prefix churn), without keeping the key.
            scope["gateway.client"] = "key:" + digest[:8]
            scope["gateway.owner"] = Owner("anon:" + digest[:32], admin)
        else:
            scope["gateway.client"], scope["gateway.owner"] = self._named_labels(keyring, identity, admin)
        return None

    def _named_labels(self, keyring: Keyring, identity: Identity, admin: bool) -> tuple[str, Owner]:
        # `admin` follows from the identity alone for a named key: the identity is the check.
        if keyring is not self._named_of:  # a reload: a name may now be another key
            self._named, self._named_of = {}, keyring
        held = self._named.get(identity.name)
        if held is None or held[0] is not identity:
            label = f"key:{identity.name}"
            held = self._named[identity.name] = (identity, label, Owner(label, admin))
        return held[1], held[2]
