"""The edge in one pass: a request's headers read once, then each rule of the door applied to them.

The rules stay in their modules, as functions of what is read here: the limits on a head
(guard.py), what open mode refuses a web page (browser.py), the key (auth.py), and which handler a
path goes to (dispatch.py). Nested one inside another as ASGI middleware they cost a layer each and
read the headers four times; here they share one dict, which the request path then reuses
(`scope["gateway.headers"]`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.edge.auth import KeyAuth
from gateway.edge.browser import BrowserGuard
from gateway.edge.guard import headers_error
from gateway.edge.paths import Paths
from gateway.edge.reject import Recorder, reject
from gateway.types import Receive, Scope, Send


class Door:
    """Header limits, browser guard, key and dispatch, in that order, over one read of the headers."""

    def __init__(
        self,
        dispatch: Paths,
        guard: BrowserGuard,
        auth: KeyAuth,
        max_header_bytes: int,
        max_header_count: int,
        record: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dispatch, self.guard, self.auth = dispatch, guard, auth
        self.max_bytes, self.max_count = max_header_bytes, max_header_count
        self.record, self.clock = record, clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.dispatch(scope, receive, send)
            return
        raw = scope["headers"]
        error = headers_error(raw, self.max_bytes, self.max_count)
        if error is None:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
            scope["gateway.headers"] = headers
            error = self.guard.refusal_of(scope["method"], headers) or self.auth.identify(scope, headers)
        if error is not None:
            await reject(scope, send, error, self.record, self.clock())
            return
        await self.dispatch(scope, receive, send)
