"""Requests about one stored Responses answer: `GET`/`DELETE /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel`. No routing and no rewriting: the replica that produced the answer
is asked (fleet/stored.py remembers which), or the gateway says it knows no such id."""

from __future__ import annotations

from gateway.caught import Caught
from gateway.dialects.registry import STORED
from gateway.errors import GatewayError, NotFound
from gateway.pipeline.attempts import Attempt
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.rewrite import Plan
from gateway.relay.respond import Responder
from gateway.types import Receive, Scope, Send, header_map


class StoredAnswers:
    """The handler the edge calls for a stored answer's path, on the proxy's record and relay."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def handle(self, response_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Serves one request about the stored answer `response_id`: 404 unless it was stored for
        the caller's key (for an admin, any key's) on a replica still in the table; else the key's
        preset and request limits are checked and the request is relayed to that replica alone, a
        successful DELETE forgetting the id. Recorded like any request."""
        proxy = self.proxy
        headers = scope.get("gateway.headers") or header_map(scope)
        ex = proxy.frame.exchange(STORED, scope, headers)
        responder = Responder(send, ex, STORED.dialect, proxy.ctx.clock)
        with proxy.frame.recorded(ex):
            # Another key's answer is as unknown as one never stored (an admin key sees all).
            where = proxy.stored.find(response_id, ex.owner)
            pool = proxy.ctx.fleet().pools.get(where[0]) if where is not None else None
            if where is None or pool is None or pool.get(where[1]) is None:
                ex.outcome = "rejected"
                error = NotFound(
                    "No stored response with this id is known to the gateway", code="response_not_found"
                )
                await responder.fail(error)
                return
            ex.preset, ex.route = pool.preset.name, "stored"
            refused: Caught[GatewayError] | None = None
            try:
                # A key's presets and request limits hold for these calls as for any of its requests.
                proxy.ctx.team.check_preset(ex.identity, pool.preset.name)
                await proxy.ctx.team.reserve(ex.identity, pool.preset.name, 0)
            except GatewayError as error:
                refused = Caught(error)
            if refused is not None:
                ex.outcome = "rejected"
                await responder.fail(refused.take())
                return
            ex.admitted = True
            deadline = proxy.ctx.clock() + pool.preset.timeouts.read
            attempt = Attempt(
                ex, pool, STORED, {}, 0, deadline, pinned=where[1], method=scope["method"], path=scope["path"]
            )
            await proxy.frame.serve(responder, proxy.send_and_relay(attempt, Plan(False, False), responder))
            if scope["method"] == "DELETE" and ex.status == 200:
                proxy.stored.forget(response_id, ex.owner)
