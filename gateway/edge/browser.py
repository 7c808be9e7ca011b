"""What a web page may not do with a gateway that has no keys.

An open gateway on a loopback address (the workstation default) is reachable from any page the
user's browser opens: by DNS rebinding (a name the attacker controls resolves to 127.0.0.1, so the
request carries the attacker's `Host`) or by a cross-site request a browser sends without asking:
a "simple" POST (`text/plain`, a form, multipart, or no Content-Type at all, which is what a
page's `fetch` with a Blob body sends), even bodyless, at /admin/* as at the chat paths. So, in
open mode only:

- on a loopback bind, a request must name a loopback host (`localhost`, `127.0.0.1`, `[::1]`, any
  port) or one listed in `GATEWAY_ALLOWED_HOSTS`; a deployment behind a proxy or a Service binds a
  non-loopback address or sets keys, and then only its own `GATEWAY_ALLOWED_HOSTS` applies;
- a request that carries an `Origin` is refused (403) unless the origin is the gateway's own (the
  `Host` the request names) or listed in `GATEWAY_CORS_ORIGINS`: browsers send `Origin` with every
  cross-origin request and every POST, and `null` from sandboxed frames and local files;
- a POST must say `Content-Type: application/json` (or a `+json` type): anything else is
  refused with 415, and so is none at all from a browser (a request with an `Origin`); other
  methods are refused the browser-simple types.

With keys set, a browser cannot add the key header cross-site without a CORS preflight, which the
gateway only grants to `GATEWAY_CORS_ORIGINS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from gateway.edge.reject import Recorder, reject
from gateway.errors import Forbidden, GatewayError, UnsupportedMediaType
from gateway.types import ASGIApp, Receive, Scope, Send, header_map

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


def allowed_origins(configured: str) -> frozenset[str]:
    """GATEWAY_CORS_ORIGINS as browsers spell an origin: `scheme://host[:port]`, lower case."""
    return frozenset(o.strip().rstrip("/").lower() for o in configured.split(",") if o.strip())


def json_type(content_type: str) -> bool:
    """`application/json` or a structured `+json` type, parameters already stripped."""
    return content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json")
    )


def same_origin(origin: str, host: str) -> bool:
    """The page that sent the request was served by this gateway under the Host it names."""
    scheme, sep, authority = origin.partition("://")
    if not sep or scheme not in ("http", "https") or not host:
        return False
    host = host.strip().lower()
    default = ":80" if scheme == "http" else ":443"
    return authority.removesuffix(default) == host.removesuffix(default)


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
        origins: Collection[str] = (),
    ) -> None:
        self.app = app
        self.open_mode = open_mode
        self.check_host = "*" not in hosts and (bool(hosts) or (open_mode and loopback))
        self.hosts = frozenset(hosts) | LOOPBACK_HOSTS
        self.origins = frozenset(origins)
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
        return self.refusal_of(scope["method"], header_map(scope))

    def refusal_of(self, method: str, headers: dict[str, str]) -> GatewayError | None:
        """The refusal of a request with these headers (lower-case names), or None."""
        host = headers.get("host", "")
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        origin = headers.get("origin")
        if origin is not None:
            origin = origin.strip().lower()
        length = headers.get("content-length", "").strip()
        has_body = "transfer-encoding" in headers or length not in ("", "0")
        if self.check_host and host_name(host) not in self.hosts:
            return Forbidden(
                "This gateway does not serve that Host name; list it in GATEWAY_ALLOWED_HOSTS "
                "(or set GATEWAY_API_KEYS) to reach it under another name",
                code="host_not_allowed",
            )
        if not self.open_mode:
            return None
        if origin is not None and origin not in self.origins and not same_origin(origin, host):
            return Forbidden(
                "A web page from another origin may not use a gateway without keys; list the origin "
                "in GATEWAY_CORS_ORIGINS (or set GATEWAY_API_KEYS)",
                code="origin_not_allowed",
            )
        # No Content-Type at all is what a page's fetch() with an untyped Blob sends, without a
        # preflight: a POST with a body must say it is JSON. A bodyless POST (an admin action, a
        # stored answer's cancel) carries nothing a page could smuggle, and the Origin check above
        # already turned away every other page.
        untyped = not content_type and (has_body or origin is not None)
        if (method == "POST" and (content_type or untyped) and not json_type(content_type)) or (
            method != "GET" and content_type in SIMPLE_TYPES
        ):
            shown = content_type[:64] or "no Content-Type"
            return UnsupportedMediaType(
                f"Send the body as application/json (Content-Type: application/json), not {shown}"
            )
        return None
