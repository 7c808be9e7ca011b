"""Which endpoint a request is for: the registry's paths go straight to the proxy; Starlette
serves the rest (models, health, status page, metrics).

Starlette's middleware stack and router cost about a fifth of the gateway's CPU per proxied
request; the proxy needs none of it (it is a raw ASGI handler with its own error renderer).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping

from gateway.dialects.registry import Endpoint, for_path, stored_id
from gateway.edge.reject import Recorder, reject
from gateway.errors import MethodNotAllowed
from gateway.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Endpoint, Scope, Receive, Send], Awaitable[None]]
StoredHandler = Callable[[str, Scope, Receive, Send], Awaitable[None]]


class Paths:
    """Sends each request to its handler by path and method: an endpoint of the registry to the
    proxy, a stored answer's path to its handler, a mounted app (/mcp) to that app, the rest to
    Starlette (fallback). A known path with the wrong method is answered 405 here."""

    def __init__(
        self,
        handle: Handler,
        stored: StoredHandler,
        fallback: ASGIApp,
        record: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
        mounts: Mapping[str, ASGIApp] | None = None,
    ) -> None:
        self.mounts = dict(mounts or {})  # whole ASGI apps at one exact path (/mcp)
        self.handle = handle
        self.stored = stored
        self.fallback = fallback
        self.record = record
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            mounted = self.mounts.get(scope["path"])
            if mounted is not None:
                await mounted(scope, receive, send)
                return
            endpoint = for_path(scope["path"])
            if endpoint is not None:
                if scope["method"] == "POST":
                    await self.handle(endpoint, scope, receive, send)
                else:
                    error = MethodNotAllowed(
                        f"Method {scope['method']} is not allowed on {endpoint.path}; use POST",
                        headers={"allow": "POST"},
                    )
                    await reject(scope, send, error, self.record, self.clock())
                return
            about = stored_id(scope["path"])
            if about is not None:
                allowed = ("POST",) if about[1] else ("GET", "DELETE")
                if scope["method"] in allowed:
                    await self.stored(about[0], scope, receive, send)
                else:
                    error = MethodNotAllowed(
                        f"Method {scope['method']} is not allowed here; use {' or '.join(allowed)}",
                        headers={"allow": ", ".join(allowed)},
                    )
                    await reject(scope, send, error, self.record, self.clock())
                return
        await self.fallback(scope, receive, send)
