"""The request path, in order; the one place that knows it.

    read body -> parse -> check -> route -> rewrite -> prefix -> pick, admit, send (attempts.py:
    retrying on another replica only before the client saw a byte) -> relay -> record

`_steps` reads as that list. The same steps serve every endpoint of the registry
(gateway/dialects/registry.py); what differs per wire format is asked of the endpoint's dialect.

A disconnect watcher runs beside each request. When the client leaves, in any phase, it cancels
the request's task, and cancellation closes the upstream connection: vLLM aborts the request,
llama-server frees the slot, and no GPU time goes to an answer nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from gateway.dialects.answer import TRAP_WARNING
from gateway.dialects.registry import STORED, Endpoint
from gateway.errors import (
    BadRequest,
    GatewayBug,
    GatewayError,
    GatewayTimeout,
    NotFound,
    NoUpstream,
    UpstreamFailure,
    UpstreamServerError,
)
from gateway.fleet.replicas import Fleet, Pool, Replica
from gateway.fleet.stored import StoredResponses
from gateway.ops.exchange import Exchange
from gateway.pipeline import prefix
from gateway.pipeline.attempts import ERROR_BODY_LIMIT, Attempt, Dispatcher, Lifecycle, RetryBudget
from gateway.pipeline.blobs import Blobs
from gateway.pipeline.body import ClientGone, decompress, parse_large, parse_object, read_body
from gateway.pipeline.rewrite import Plan, check_request, requested_task, rewrite
from gateway.relay import respond as relay
from gateway.routing.balancer import POLICIES
from gateway.routing.fallback import Reason, Standing, context_error, estimate_tokens, why_not
from gateway.routing.fallback import choose as choose_fallback
from gateway.routing.fallback import header_value as fallback_header
from gateway.routing.table import Preset
from gateway.settings import Settings
from gateway.team.keys import OPEN, Identity
from gateway.team.team import Team
from gateway.types import Receive, Scope, Send
from gateway.upstream import UpstreamClient, UpstreamError, UpstreamResponse

Recorder = Callable[[Exchange], None]

# Headers by which agents name their session: the prefix-affinity key where present, so every turn
# of one agent session reaches the replica that holds its prefix.
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id", "x-session-affinity")
log = logging.getLogger("gateway.pipeline.proxy")
prefix_log = logging.getLogger("gateway.pipeline.prefix")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


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


class _Watch:
    """Shared by a request and its disconnect watcher."""

    __slots__ = ("client_left", "serving")

    def __init__(self) -> None:
        self.serving = True
        self.client_left = False


class Proxy:
    def __init__(self, context: Context) -> None:
        self.ctx = context
        self.budget = RetryBudget()
        self.dispatcher = Dispatcher(
            context.client,
            self.budget,
            context.settings.offload_bytes,
            context.sleep,
            context.clock,
            pools=lambda name: context.fleet().pools.get(name),
            lifecycle=context.lifecycle,
        )
        self._background: set[asyncio.Future[None]] = set()
        self.volatile = prefix.VolatileCache()
        self.churn = prefix.ChurnTracker()
        self.stored = StoredResponses()
        # Request ids: random per process, then a counter; cheaper than a uuid per request.
        self._ids = (f"{os.urandom(6).hex()}-{n}" for n in itertools.count(1))

    def _exchange(self, endpoint: Endpoint, scope: Scope, headers: dict[str, str]) -> Exchange:
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
        )

    async def handle(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        ex = self._exchange(endpoint, scope, headers)
        self.budget.active += 1
        try:
            await self._handle(endpoint, headers, ex, receive, send)
        finally:
            self.budget.active -= 1
            if ex.finished is None:
                ex.finished = self.ctx.clock()
            if ex.answer.thinking_trap:
                ex.warnings.append(("thinking_trap", TRAP_WARNING))
            self.ctx.record(ex)

    async def _handle(
        self, endpoint: Endpoint, headers: dict[str, str], ex: Exchange, receive: Receive, send: Send
    ) -> None:
        settings = self.ctx.settings
        length = headers.get("content-length")
        try:
            raw = await read_body(
                receive,
                int(length) if length and length.isdigit() else None,
                settings.max_body_bytes,
                settings.body_timeout,
            )
            encoding = headers.get("content-encoding", "")
            if encoding:
                # Inflating megabytes holds the loop as parsing them would: same threshold, same thread.
                if len(raw) * 8 > settings.offload_bytes:
                    raw = await asyncio.to_thread(decompress, raw, encoding, settings.max_body_bytes)
                else:
                    raw = decompress(raw, encoding, settings.max_body_bytes)
        except ClientGone:
            ex.outcome, ex.disconnect_phase = "client_disconnected", "reading"
            return
        except GatewayError as error:
            ex.outcome = "rejected"
            await relay.send_error(send, ex, error, endpoint.dialect)
            return
        task = asyncio.current_task()
        assert task is not None
        watch = _Watch()
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, task, watch))
        try:
            await self._serve(endpoint, ex, send, self._steps(endpoint, headers, raw, ex, send))
        except asyncio.CancelledError:
            if not watch.client_left:
                # The server is stopping and the drain period is over: say so rather than go silent.
                await _shutdown_reply(send, ex, endpoint)
                raise
            task.uncancel()
            ex.outcome = "client_disconnected"
            ex.disconnect_phase = "streaming" if ex.headers_sent else "waiting"
        finally:
            watch.serving = False
            watcher.cancel()

    async def _serve(
        self, endpoint: Endpoint, ex: Exchange, send: Send, steps: Coroutine[Any, Any, None]
    ) -> None:
        """Runs the steps; a failure before the response headers becomes the gateway's own reply."""
        try:
            await steps
        except GatewayError as error:
            if ex.stream_opened:
                # Loading comments opened the stream: the failure is its one error event.
                ex.outcome = "upstream_error" if ex.attempts else "rejected"
                ex.error_code = str(error.code)
                await relay.end_stream(send, ex, error.message, str(error.code), endpoint.dialect)
                return
            if ex.headers_sent:
                raise
            if isinstance(error, GatewayBug):
                # One line with the cause for the operator; the client gets the envelope only.
                log.error(
                    "request %s failed inside the gateway", ex.request_id, exc_info=error.__cause__ or error
                )
            if ex.outcome == "completed":
                ex.outcome = "upstream_error" if ex.attempts else "rejected"
            await relay.send_error(send, ex, error, endpoint.dialect)
        except Exception as exc:
            if ex.headers_sent:
                raise
            log.error("request %s failed inside the gateway", ex.request_id, exc_info=exc)
            ex.outcome = "rejected"
            bug = GatewayBug(f"The gateway failed on this request; request {ex.request_id}")
            await relay.send_error(send, ex, bug, endpoint.dialect)

    async def _steps(
        self, endpoint: Endpoint, headers: dict[str, str], raw: bytes | bytearray, ex: Exchange, send: Send
    ) -> None:
        settings, fleet, team = self.ctx.settings, self.ctx.fleet(), self.ctx.team
        body, blobs = await self._parse(raw)
        check_request(body, endpoint)
        if settings.log_prompts:  # off by default: prompts are the users' data, not the operator's
            ex.prompt = body.get("messages", body.get("prompt", body.get("input")))
        preset = self._route(endpoint, body, headers, ex, fleet)
        identity = ex.identity
        team.check_preset(identity, preset.name)
        lowered = headers.get("x-gateway-priority", "").strip().lower() == "batch"
        ex.priority = "batch" if identity.priority == "batch" or lowered else "interactive"
        ticket: int | None = await team.ticket(identity, preset.name)
        ex.admitted = True
        options = self._fallbacks(preset, endpoint, identity, headers, fleet)
        patience = _patience(headers)
        tokens = estimate_tokens(body)
        if (chosen := self._before_sending(ex, preset, options, tokens, patience)) is not preset:
            preset, ticket = chosen, None  # the shared ticket was the asked preset's position
        tried = [preset.name]
        async with team.running(identity, preset.limits.queue_timeout, preset.limits.queue):
            while True:
                may_fall_back = any(p.name not in tried for p in options)
                try:
                    await self._serve_preset(
                        endpoint,
                        headers,
                        body,
                        blobs,
                        len(raw),
                        ex,
                        send,
                        preset,
                        ticket,
                        patience,
                        may_fall_back,
                    )
                    return
                except GatewayError as error:
                    reason = _fallback_reason(error)
                    if reason is None or not may_fall_back or (ex.headers_sent and not ex.stream_opened):
                        raise
                    target = self._choose(options, reason, tokens, tried)
                    if target is None:
                        raise
                preset, ticket = self._fall_back(ex, preset, target, reason), None
                tried.append(preset.name)
                if ex.stream_opened:
                    await relay.comment(send, f"fallback {ex.fallback}")
                body, blobs = await self._parse(raw)  # the rewrites of the preset it leaves, undone

    async def _serve_preset(
        self,
        endpoint: Endpoint,
        headers: dict[str, str],
        body: dict[str, Any],
        blobs: Blobs,
        size: int,
        ex: Exchange,
        send: Send,
        preset: Preset,
        ticket: int | None,
        patience: float | None,
        may_fall_back: bool,
    ) -> None:
        """Rewrite, prefix, attempts and relay, for one preset."""
        plan = rewrite(body, preset, endpoint, want_usage=True)
        ex.rewrites[:] = plan.notes
        ex.stream = plan.stream
        key = self._prefix(body, ex, preset, headers)
        attempt = Attempt(
            ex,
            self.ctx.fleet().pools[preset.name],
            endpoint,
            body,
            size,
            self.ctx.clock() + preset.timeouts.read,
            key=key,
            blobs=blobs,
            forward=[(name, headers[name]) for name in endpoint.forward if name in headers],
            pinned=self._pinned(body, preset),
            batch=ex.priority == "batch",
            shared_ticket=ticket,
            patience=patience,
            context_fallback=may_fall_back,
        )
        if plan.stream:

            async def loading(seconds: float) -> None:
                await relay.loading_comment(send, ex, preset.name, seconds)

            attempt.on_load_wait = loading
        await self._send_and_relay(attempt, plan, send)

    def _before_sending(
        self, ex: Exchange, preset: Preset, options: list[Preset], tokens: int, patience: float | None
    ) -> Preset:
        """The preset that should take the request before anything is sent: the asked one, or
        its first fallback that can serve when the asked one cannot (down, failed, loading
        longer than the client waits, full, prompt past its context). A prompt past the context
        with no fallback is refused here, before any GPU time."""
        standing = self._standing(self.ctx.fleet().pools[preset.name])
        wait = preset.timeouts.load if patience is None else patience
        reason = why_not(standing, tokens, wait)
        if reason is None:
            return preset
        target = self._choose(options, reason, tokens, [preset.name])
        if target is not None:
            return self._fall_back(ex, preset, target, reason)
        if reason == "context":
            raise _too_long(preset, tokens, standing.context, options)
        return preset  # no fallback can take it: the preset's own answer (a wait, a 429, a 503)

    def _fallbacks(
        self, preset: Preset, endpoint: Endpoint, identity: Identity, headers: dict[str, str], fleet: Fleet
    ) -> list[Preset]:
        """The presets this request may fall back to, in the table's order: ones its key may use
        and that serve its endpoint; none when the client says `x-gateway-fallback: none`."""
        if headers.get("x-gateway-fallback", "").strip().lower() == "none":
            return []
        found = (fleet.table.presets.get(name) for name in preset.fallback)
        return [p for p in found if p is not None and identity.allows(p.name) and _serves(p, endpoint)]

    def _choose(self, options: list[Preset], reason: Reason, tokens: int, tried: list[str]) -> str | None:
        pools = self.ctx.fleet().pools
        standings = [(p.name, self._standing(pools[p.name])) for p in options if p.name in pools]
        return choose_fallback(standings, reason, tokens, skip=tried)

    def _fall_back(self, ex: Exchange, preset: Preset, target: str, reason: Reason) -> Preset:
        chosen = self.ctx.fleet().table.presets[target]
        ex.fallback = ex.fallback or fallback_header(preset.name, target, reason)
        ex.fallback_reason = ex.fallback_reason or reason
        ex.fallback_from = ex.fallback_from or preset.name
        ex.preset, ex.outcome, ex.error_code = chosen.name, "completed", None
        log.info("request %s falls back %s -> %s (%s)", ex.request_id, preset.name, target, reason)
        return chosen

    def _standing(self, pool: Pool) -> Standing:
        """What the pool can do now, read from its replicas and the supervisor."""
        now, lifecycle = self.ctx.clock(), self.ctx.lifecycle
        failed, loadable, expected = lifecycle.outlook(pool) if lifecycle else (False, False, None)
        stopped = set(lifecycle.unavailable(pool)) if lifecycle else set()
        usable = [r for r in pool.replicas if r.name not in stopped]
        available = any(r.health.available(now) for r in usable)
        free = any(r.in_flight < r.limit for r in usable) or pool.queued < pool.preset.limits.queue
        contexts = [r.context for r in pool.replicas if r.context]
        return Standing(available, free, failed, loadable, expected, min(contexts) if contexts else None)

    def _pinned(self, body: dict[str, Any], preset: Preset) -> str | None:
        """A request that continues a stored response goes to the replica that holds it."""
        previous = body.get("previous_response_id")
        where = self.stored.find(previous) if isinstance(previous, str) else None
        return where[1] if where is not None and where[0] == preset.name else None

    async def handle_stored(self, response_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        """`GET`/`DELETE /v1/responses/{id}`, `POST .../cancel`: no routing, no rewriting; the
        replica that produced the response answers, or the gateway says it knows no such id."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        ex = self._exchange(STORED, scope, headers)
        self.budget.active += 1
        try:
            where = self.stored.find(response_id)
            fleet = self.ctx.fleet()
            pool = fleet.pools.get(where[0]) if where is not None else None
            if where is None or pool is None or pool.get(where[1]) is None:
                ex.outcome = "rejected"
                error = NotFound(
                    "No stored response with this id is known to the gateway", code="response_not_found"
                )
                await relay.send_error(send, ex, error, STORED.dialect)
                return
            ex.preset, ex.route = pool.preset.name, "stored"
            attempt = Attempt(
                ex,
                pool,
                STORED,
                {},
                0,
                self.ctx.clock() + pool.preset.timeouts.read,
                pinned=where[1],
                method=scope["method"],
                path=scope["path"],
            )
            await self._serve(STORED, ex, send, self._send_and_relay(attempt, Plan(False, False), send))
            if scope["method"] == "DELETE" and ex.status == 200:
                self.stored.forget(response_id)
        finally:
            self.budget.active -= 1
            if ex.finished is None:
                ex.finished = self.ctx.clock()
            self.ctx.record(ex)

    async def _parse(self, raw: bytes | bytearray) -> tuple[dict[str, Any], Blobs]:
        settings = self.ctx.settings
        if len(raw) > settings.offload_bytes:
            return await asyncio.to_thread(parse_large, raw, settings.max_json_depth)
        return parse_object(raw, settings.max_json_depth), Blobs()

    def _route(
        self, endpoint: Endpoint, body: dict[str, Any], headers: dict[str, str], ex: Exchange, fleet: Fleet
    ) -> Preset:
        """Model, alias or pattern, else task, else the default; images to vision; then a preset
        with the capability and an engine that serves the endpoint."""
        table = fleet.table
        model = body.get("model")
        task = requested_task(body, headers.get("x-task"))
        route = table.resolve(model, task, endpoint.dialect.has_images(body))
        preset, reason = route.preset, route.reason
        if not _serves(preset, endpoint):
            # Only on a miss: the scan of every preset stays off the common path.
            able = [p for p in table.presets.values() if _serves(p, endpoint)]
            chosen = (model is not None and model != "auto") or task is not None
            if chosen or not able:
                names = ", ".join(p.name for p in able) or "none"
                raise BadRequest(
                    f"Preset '{preset.name}' does not serve {endpoint.path}; presets that do: {names}",
                    code="endpoint_not_served",
                )
            preset, reason = able[0], "capability"
        ex.preset, ex.route = preset.name, reason
        return preset

    async def _send_and_relay(self, attempt: Attempt, plan: Plan, send: Send) -> None:
        ex, preset = attempt.ex, attempt.pool.preset
        loop_deadline = asyncio.get_running_loop().time() + preset.timeouts.read
        try:
            # One deadline for the whole answer, retries included.
            async with asyncio.timeout_at(loop_deadline):
                if preset.abort_on_disconnect:
                    response, replica = await self.dispatcher.open(attempt)
                else:
                    response, replica = await self._open_detachable(attempt, loop_deadline)
                # attempt.pool, not `pool`: a reload while it queued moves it to the new table's pool.
                await self._relay(attempt, plan, response, replica, send, loop_deadline)
        except TimeoutError:
            ex.outcome, ex.error_code = "upstream_error", "deadline_exceeded"
            message = f"No answer within the preset's deadline of {preset.timeouts.read:g} s"
            if not ex.headers_sent:
                raise GatewayTimeout(message, code="deadline_exceeded") from None
            if ex.stream:
                await relay.end_stream(
                    send,
                    ex,
                    f"{message}; request {ex.request_id}",
                    "deadline_exceeded",
                    attempt.endpoint.dialect,
                )

    async def _relay(
        self,
        attempt: Attempt,
        plan: Plan,
        response: UpstreamResponse,
        replica: Replica,
        send: Send,
        loop_deadline: float,
    ) -> None:
        detach = False
        ex, endpoint, release = attempt.ex, attempt.endpoint, attempt.release
        preset, settings = attempt.pool.preset, self.ctx.settings
        try:
            if response.status >= 300:
                await self._relay_status(attempt, replica, response, send)
            elif plan.stream:
                await relay.send_stream(
                    send,
                    ex,
                    response,
                    drop_usage=plan.usage_injected,
                    write_timeout=settings.write_timeout,
                    clock=self.ctx.clock,
                    progress=replica.health.progress,
                    dialect=endpoint.dialect,
                    max_event=settings.max_event_bytes,
                )
            else:
                await relay.send_whole(
                    send,
                    ex,
                    response,
                    self.ctx.clock,
                    endpoint.dialect,
                    limit=settings.max_answer_bytes,
                    offload=settings.offload_bytes,
                )
        except UpstreamError as error:
            ex.outcome = "upstream_error"
            ex.upstream_errors.append(error.kind)
            raise UpstreamFailure("The replica's answer broke off", code="upstream_disconnected") from None
        except asyncio.CancelledError:
            # A cancellation is the deadline, the client leaving or the server stopping; only the
            # last two may leave a detachable answer running.
            detach = not preset.abort_on_disconnect and not _past(loop_deadline)
            raise
        finally:
            if endpoint.stores and ex.answer.response_id:
                self.stored.remember(ex.answer.response_id, preset.name, replica.name)
            if ex.answer.prompt_tokens:
                replica.prompt_tokens += ex.answer.prompt_tokens
                replica.cached_tokens += ex.answer.cached_tokens or 0
            if detach:
                self._detach(_drain(response, release, replica, loop_deadline))
            else:
                await _release(response, release, replica)

    async def _open_detachable(
        self, attempt: Attempt, loop_deadline: float
    ) -> tuple[UpstreamResponse, Replica]:
        """For engines that mishandle aborts (`abort_on_disconnect: false`): a client that leaves
        before the answer starts does not cancel the replica's work; it runs on, unread."""

        async def open_by_deadline() -> tuple[UpstreamResponse, Replica]:
            async with asyncio.timeout_at(loop_deadline):
                return await self.dispatcher.open(attempt)

        opening = asyncio.ensure_future(open_by_deadline())
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:

            def finish(done: asyncio.Future[tuple[UpstreamResponse, Replica]]) -> None:
                if not done.cancelled() and done.exception() is None:
                    response, replica = done.result()
                    self._detach(_drain(response, attempt.release, replica, loop_deadline))

            opening.add_done_callback(finish)
            raise

    def _detach(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _prefix(self, body: dict[str, Any], ex: Exchange, spec: Preset, headers: dict[str, str]) -> str:
        """Volatile content, the prefix fingerprint and churn; returns the affinity key."""
        session = _session(body, headers)
        preset, mode = spec.name, spec.prefix.volatile
        keyed = POLICIES[spec.policy].needs_key
        report = prefix.apply(body, mode, preset, self.volatile, session, keyed=keyed)
        ex.prefix, ex.prefix_found = report.fingerprint, report.kinds
        if report.kinds and mode in ("move", "strip"):
            action = "moved" if report.moved else "stripped" if mode == "strip" else "found"
            ex.rewrites.append((f"prefix_{action}", f"prefix={action}:" + "+".join(report.kinds)))
        # A session name is the client's own text, of any length and content: only a short hash
        # of it is kept (churn tracking) or logged (no forged lines, no e-mail address in logs).
        client = ex.client_id + (f"/s:{_digest(session)}" if session else "")
        ex.prefix_churn = self.churn.observe(client, preset, report.fingerprint)
        if report.kinds and self.churn.first_report(client, report.template):
            effect = (
                "the gateway keeps it out of the prefix"
                if mode in ("move", "strip")
                else "its prefix cache cannot hit"
            )
            prefix_log.warning(
                "volatile content (%s) in the system prompt of client %s, preset %s (prefix %s): "
                "%s; see docs/prefix-cache.md",
                ",".join(report.kinds),
                client,
                preset,
                report.template,
                effect,
            )
        return report.affinity_key or ""

    async def _relay_status(
        self, attempt: Attempt, replica: Replica, response: UpstreamResponse, send: Send
    ) -> None:
        """A replica's own error: its 4xx keeps status and message, anything else becomes ours."""
        ex, endpoint = attempt.ex, attempt.endpoint
        data = await response.read(ERROR_BODY_LIMIT)
        if response.status < 400:
            raise UpstreamFailure("The replica answered with a redirect, which the gateway does not follow")
        if response.status >= 500:
            ex.outcome = "upstream_error"
            raise UpstreamServerError(
                f"The replica failed to answer (HTTP {response.status}); request {ex.request_id}"
            )
        key = replica.api_key()
        secrets = (key,) if key else ()
        if attempt.context_fallback and context_error(response.status, data):
            message = relay.upstream_error(response.status, data, secrets, endpoint.dialect)[0]
            raise ContextExceeded(message)
        if ex.stream_opened:  # the status line went out with the loading comments: an error event
            message = relay.upstream_error(response.status, data, secrets, endpoint.dialect)[0]
            raise UpstreamFailure(message, code=str(response.status))
        body = relay.upstream_error_body(response.status, data, ex.request_id, secrets, endpoint.dialect)
        ex.status, ex.error_code = response.status, str(response.status)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *relay.gateway_headers(ex),
        ]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        ex.headers_sent = True
        await send({"type": "http.response.body", "body": body})


async def _shutdown_reply(send: Send, ex: Exchange, endpoint: Endpoint) -> None:
    ex.outcome, ex.error_code = "upstream_error", "shutdown"
    message = f"The gateway is shutting down; request {ex.request_id} was cut off"
    with contextlib.suppress(Exception):
        if ex.headers_sent and ex.stream:
            await relay.end_stream(send, ex, message, "shutdown", endpoint.dialect)
        elif not ex.headers_sent:
            error = NoUpstream(message, code="shutdown", headers={"retry-after": "5"})
            await relay.send_error(send, ex, error, endpoint.dialect)


class ContextExceeded(BadRequest):
    """A replica refused the prompt as longer than its context, and a fallback may take it."""

    default_code = "context_length_exceeded"


# Which failures before the answer started hand a request to a fallback preset, by error code.
_FALLBACK_CODES: dict[str, Reason] = {
    "queue_full": "full",
    "replica_failed": "failed",
    "load_timeout": "loading",
    "no_healthy_upstream": "down",
    "upstream_unavailable": "down",
    "context_length_exceeded": "context",
}


def _fallback_reason(error: GatewayError) -> Reason | None:
    return _FALLBACK_CODES.get(str(error.code))


def _patience(headers: dict[str, str]) -> float | None:
    """`x-gateway-max-wait: SECONDS`: how long the client will wait for a preset to load."""
    value = headers.get("x-gateway-max-wait")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise BadRequest(
            "x-gateway-max-wait must be a number of seconds",
            code="invalid_header",
            param="x-gateway-max-wait",
        ) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise BadRequest(
            "x-gateway-max-wait must be 0 or more seconds", code="invalid_header", param="x-gateway-max-wait"
        )
    return seconds


def _too_long(preset: Preset, tokens: int, context: int | None, options: list[Preset]) -> BadRequest:
    tail = "; none of its fallbacks can take it" if options else ""
    return BadRequest(
        f"The prompt is about {tokens} tokens (estimated from its text), more than preset "
        f"'{preset.name}' holds: its context is {context} tokens{tail}. Shorten the prompt or ask for a "
        "preset with a longer context",
        code="context_length_exceeded",
        param="messages",
    )


def _serves(preset: Preset, endpoint: Endpoint) -> bool:
    if endpoint.needs is not None and not getattr(preset, endpoint.needs):
        return False
    engines = {r.engine for r in preset.replicas} | ({preset.discover.engine} if preset.discover else set())
    return not engines or any(endpoint.serves(engine) for engine in engines)


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=6).hexdigest()


def _session(body: dict[str, Any], headers: dict[str, str]) -> str | None:
    """The client's own name for its session, where it gives one."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return value
    for key in ("prompt_cache_key", "user"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return value
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user_id if isinstance(user_id, str) and user_id else None


def _past(loop_deadline: float) -> bool:
    return asyncio.get_running_loop().time() >= loop_deadline


async def _drain(
    response: UpstreamResponse, release: Callable[[Replica], None], replica: Replica, loop_deadline: float
) -> None:
    """Let the replica finish an answer nobody reads, then give its place back."""
    try:
        async with asyncio.timeout_at(loop_deadline):
            async for _ in response.chunks():
                pass
    except (TimeoutError, UpstreamError):
        pass
    finally:
        await _release(response, release, replica)


async def _release(response: UpstreamResponse, release: Callable[[Replica], None], replica: Replica) -> None:
    try:
        await response.close()
    finally:
        release(replica)


async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any], watch: _Watch) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if watch.serving:
        watch.client_left = True
        task.cancel()
