"""The frame around every request on the proxy's path: what the path needs from the running
gateway (`Context`), the request's record made once and recorded once, the client watched while it
runs, and a failure turned into the client's reply before its answer started, or into the end of
its stream after.

Envoy's rule decides what a failure becomes: before the status line, a local reply in the client's
dialect; once a replica's stream is on its way, the stream ends with the dialect's one error event
(never silently: a client cannot tell a cut stream from a short answer otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.caught import Caught, raise_again
from gateway.dialects.answer import TRAP_WARNING
from gateway.dialects.registry import Endpoint
from gateway.errors import GatewayBug, GatewayError
from gateway.fleet.replicas import Fleet
from gateway.fleet.stored import Owner
from gateway.ops.exchange import Exchange
from gateway.pipeline.attempts import Lifecycle, RetryBudget
from gateway.pipeline.disconnect import ClientLink, Watching
from gateway.pipeline.tool_images import Describe
from gateway.relay.respond import Responder
from gateway.settings import Settings
from gateway.team.keys import OPEN
from gateway.team.team import Team
from gateway.types import Receive, Scope
from gateway.upstream import UpstreamClient

Recorder = Callable[[Exchange], None]
log = logging.getLogger("gateway.pipeline.proxy")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _numbered(prefix: str) -> Iterator[str]:
    """`prefix-1`, `prefix-2`, ... without end. A generator function, not an expression: mypyc
    (docs/benchmarks.md) builds a generator expression's whole list at once."""
    for n in itertools.count(1):
        yield f"{prefix}-{n}"


@dataclass
class Context:
    """What the request path needs from the running gateway."""

    settings: Settings
    fleet: Callable[[], Fleet]
    client: UpstreamClient
    record: Recorder
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    clock: Callable[[], float] = time.monotonic
    lifecycle: Lifecycle | None = None  # the supervisor of launched replicas
    team: Team = field(default_factory=Team.solo)  # keys, limits and usage
    describe: Describe | None = None  # an image described by the vision preset (pipeline/tool_images.py)


class Frame:
    """Records, watches and answers for each request of the proxy's path (see the module docstring)."""

    def __init__(self, context: Context, budget: RetryBudget) -> None:
        self.ctx, self.budget = context, budget
        # Request ids: random per process, then a counter; cheaper than a uuid per request. The
        # prefix is drawn here, once: inside the generator it would be drawn (a syscall) per id.
        prefix = os.urandom(6).hex()
        self._ids = _numbered(prefix)

    def exchange(self, endpoint: Endpoint, scope: Scope, headers: dict[str, str]) -> Exchange:
        """The request's record, begun: who sent it, to which endpoint, under which id."""
        given_id = headers.get("x-request-id")
        client = scope.get("client")
        tool = scope.get("gateway.tool")  # an MCP tool call, run in process on this path
        return Exchange(
            request_id=given_id if given_id and _REQUEST_ID.match(given_id) else next(self._ids),
            endpoint="mcp" if tool else endpoint.name,
            tool=tool or "",
            started=self.ctx.clock(),
            client=client[0] if client else "",
            client_id=scope.get("gateway.client") or (f"ip:{client[0]}" if client else "ip:unknown"),
            identity=scope.get("gateway.identity") or OPEN,
            owner=Owner.of(scope),
        )

    @contextlib.contextmanager
    def recorded(self, ex: Exchange) -> Iterator[None]:
        """`begin` and `end` around a block (the request path calls them itself: no generator)."""
        self.begin()
        try:
            yield
        finally:
            self.end(ex)

    def begin(self) -> None:
        """The request is active (the retry budget counts active requests) until `end`."""
        self.budget.active += 1

    def end(self, ex: Exchange) -> None:
        """The request has ended, however it did: recorded once."""
        self.budget.active -= 1
        if ex.finished is None:
            ex.finished = self.ctx.clock()
        if ex.answer.thinking_trap:
            ex.warnings.append(("thinking_trap", TRAP_WARNING))
        self.ctx.record(ex)

    async def watched(
        self,
        receive: Receive,
        responder: Responder,
        work: Coroutine[Any, Any, None],
        link: ClientLink | None = None,
    ) -> None:
        """Runs `work` while watching for the client leaving; says so in the record when it does."""
        ex = responder.ex
        stopping: Caught[asyncio.CancelledError] | None = None
        with Watching(receive, link) as presence:
            try:
                await work
            except asyncio.CancelledError as cancelled:
                if presence.client_left:
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    ex.outcome = "client_disconnected"
                    ex.disconnect_phase = "streaming" if responder.started else "waiting"
                else:
                    stopping = Caught(cancelled)
            if stopping is not None:
                # The server is stopping and the drain period is over: say so rather than go silent.
                with contextlib.suppress(Exception):
                    await responder.shutdown()
                raise_again(stopping)

    async def serve(self, responder: Responder, steps: Coroutine[Any, Any, None]) -> None:
        """Runs the steps; a failure before a replica's answer started becomes the gateway's reply,
        one after a stream started ends that stream with the dialect's error event."""
        try:
            await steps
            return
        except Exception as failure:
            caught = Caught(failure)
        await _failed(responder, caught.take())


async def _failed(responder: Responder, exc: Exception) -> None:
    """What `serve` does with a failure, out of the frame that caught it (caught.py)."""
    ex = responder.ex
    if isinstance(exc, GatewayError):
        if responder.started and not responder.opened:
            await _cut(responder, exc, exc.message, str(exc.code))
            return
        if isinstance(exc, GatewayBug):
            # One line with the cause for the operator; the client gets the envelope only.
            log.error("request %s failed inside the gateway", ex.request_id, exc_info=exc.__cause__ or exc)
        if responder.opened or ex.outcome == "completed":
            ex.outcome = "upstream_error" if ex.attempts else "rejected"
        await responder.fail(exc)
    else:
        log.error("request %s failed inside the gateway", ex.request_id, exc_info=exc)
        message = f"The gateway failed on this request; request {ex.request_id}"
        if responder.started and not responder.opened:
            await _cut(responder, exc, message, "internal_error")
            return
        ex.outcome = "rejected"
        await responder.fail(GatewayBug(message))


async def _cut(responder: Responder, error: Exception, message: str, code: str) -> None:
    """A failure after a replica's answer started: a stream ends with the dialect's error event; a
    whole answer already on its way cannot be mended, and the connection is closed."""
    ex = responder.ex
    ex.outcome, ex.error_code = "upstream_error", code
    if not ex.stream:
        raise error
    with contextlib.suppress(Exception):
        await responder.end(message, code)
