"""What a web page may not do with a gateway that has no keys.

An open gateway on a loopback address (the workstation default) is reachable from any page the
user's browser opens: by DNS rebinding (a name the attacker controls resolves to 127.0.0.1, so the
request carries the attacker's `Host`) or by a "simple" cross-site POST, which a browser sends
without asking when the body is `text/plain`, a form or multipart. So, in open mode only:

- on a loopback bind, a request must name a loopback host (`localhost`, `127.0.0.1`, `[::1]`, any
  port) or one listed in `GATEWAY_ALLOWED_HOSTS`; a deployment behind a proxy or a Service binds a
  non-loopback address or sets keys, and then only its own `GATEWAY_ALLOWED_HOSTS` applies;
- a body sent as one of the browser-simple content types is refused with 415 (send
  `application/json`).

With keys set, a browser cannot add the key header cross-site without a CORS preflight, which the
gateway only grants to `GATEWAY_CORS_ORIGINS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from gateway.edge.reject import Recorder, reject
from gateway.errors import Forbidden, GatewayError, UnsupportedMediaType
from gateway.types import ASGIApp, Receive, Scope, Send

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
# The content types a browser sends cross-site without a preflight (the Fetch standard's list).
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def host_name(value: str) -> str:
    """The name part of a Host header: `[::1]:8000` -> `[::1]`, `Example.COM:80` -> `example.com`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value.split("]", 1)[0] + "]"
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def allowed_hosts(configured: str) -> frozenset[str]:
    return frozenset(host_name(h) for h in configured.split(",") if h.strip())


class BrowserGuard:
    """Host allow-list and content-type refusal (see the module's docstring for when each holds)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        open_mode: bool,
        loopback: bool,
        hosts: Collection[str],
        record: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.open_mode = open_mode
        self.check_host = "*" not in hosts and (bool(hosts) or (open_mode and loopback))
        self.hosts = frozenset(hosts) | LOOPBACK_HOSTS
        self.record = record
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self.refusal(scope)
            if error is not None:
                await reject(scope, send, error, self.record, self.clock())
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> GatewayError | None:
        host = content_type = ""
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"content-type":
                content_type = value.decode("latin-1").split(";", 1)[0].strip().lower()
        if self.check_host and host_name(host) not in self.hosts:
            return Forbidden(
                "This gateway does not serve that Host name; list it in GATEWAY_ALLOWED_HOSTS "
                "(or set GATEWAY_API_KEYS) to reach it under another name",
                code="host_not_allowed",
            )
        if self.open_mode and scope["method"] != "GET" and content_type in SIMPLE_TYPES:
            return UnsupportedMediaType(
                f"Send the body as application/json (Content-Type: application/json), not {content_type}"
            )
        return None
