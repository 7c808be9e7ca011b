"""Requests the edge turns away before the request path (401, 404, 405, 431): answered in the
client's own dialect and recorded like any other request, so key guessing and agents that call
a path the gateway does not serve show in the access log and the metrics."""

from __future__ import annotations

import os
from collections.abc import Callable

from gateway.dialects.registry import dialect_for, for_path
from gateway.errors import GatewayError
from gateway.ops.exchange import Exchange
from gateway.relay.respond import send_error
from gateway.team.keys import OPEN
from gateway.types import Scope, Send

Recorder = Callable[[Exchange], None]


def endpoint_label(path: str) -> str:
    """A bounded metric label: an endpoint's name, or `other` for any path a client invents."""
    endpoint = for_path(path)
    if endpoint is not None:
        return endpoint.name
    if path.startswith("/v1/responses/"):
        return "responses_stored"
    return "other"


async def reject(
    scope: Scope, send: Send, error: GatewayError, record: Recorder | None, clock: float
) -> None:
    """Answers a request the edge turns away with `error` in its path's dialect, and records it as a
    rejected exchange (timed at `clock`, with the caller's identity where the key check set one)
    even when the send fails."""
    client = scope.get("client")
    ex = Exchange(
        request_id=os.urandom(8).hex(),
        endpoint=endpoint_label(scope.get("path", "")),
        started=clock,
        client=client[0] if client else "",
        outcome="rejected",
        identity=scope.get("gateway.identity") or OPEN,  # past the key check: whose request it was
    )
    try:
        await send_error(send, ex, error, dialect_for(scope.get("path", "")))
    finally:
        ex.finished = clock
        if record is not None:
            record(ex)
