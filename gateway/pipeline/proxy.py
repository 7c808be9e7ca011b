"""The request path, in order; the one place that knows it.

    read body -> parse -> check -> route -> key -> fallback -> rewrite -> prefix
        -> pick, admit, send (attempts.py: another replica only before the client saw a byte)
        -> relay -> record

`Proxy._steps` reads as that list, each step a call into the module that owns it; the same steps
serve every endpoint of the registry (dialects/registry.py), and what differs per wire format is
asked of the endpoint's dialect. `Responder` (relay/respond.py) alone writes to the client and
knows what went out; `Exchange` (ops/exchange.py) is the record the steps fill in, read once at the
end by metrics, the access log, the status page and the key's usage.

Around the steps, frame.py records the request once, watches for its client leaving (disconnect.py:
cancellation closes the upstream connection, so vLLM aborts and llama-server frees the slot) and
turns a failure into the client's reply.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any

from gateway.answers.assemble import assembler_for
from gateway.caught import Caught, raise_again
from gateway.dialects import tool_schemas
from gateway.dialects.registry import WHOLE_AS_STREAM, Endpoint
from gateway.errors import ContextExceeded, GatewayError, GatewayTimeout, UpstreamFailure
from gateway.fleet.replicas import Replica
from gateway.fleet.stored import StoredResponses
from gateway.ops.exchange import Exchange
from gateway.pipeline.attempts import Attempt, Dispatcher, RetryBudget, finish
from gateway.pipeline.blobs import Blobs
from gateway.pipeline.body import ClientGone, parse, read_request
from gateway.pipeline.deadline import Deadline
from gateway.pipeline.disconnect import ClientLink
from gateway.pipeline.fallback import Fallbacks, patience
from gateway.pipeline.frame import Context, Frame
from gateway.pipeline.prefix import PrefixStep
from gateway.pipeline.rewrite import Plan, check_request, rewrite
from gateway.pipeline.server_rounds import serve_rounds
from gateway.pipeline.session import session_of
from gateway.pipeline.tokens import prompt_tokens, reservation
from gateway.pipeline.tool_images import ToolImages
from gateway.pipeline.walk import KnownTools, ToolsJson
from gateway.relay.keepalive import KeepAlive
from gateway.relay.replica_errors import ERROR_BODY_LIMIT, relay_replica_error
from gateway.relay.respond import Responder
from gateway.relay.stream import relay_stream
from gateway.relay.whole import relay_assembled, relay_whole
from gateway.routing.balancer import POLICIES
from gateway.routing.route import route
from gateway.routing.table import Preset
from gateway.servertools import loop as server_tools
from gateway.types import Receive, Scope, Send, header_map
from gateway.upstream import UpstreamError, UpstreamResponse

log = logging.getLogger("gateway.pipeline.proxy")


class _Loosened(Exception):
    """An engine refused the tool schemas: the body to send once more (dialects/tool_schemas.py)."""

    def __init__(self, body: dict[str, Any], note: tuple[str, str]) -> None:
        super().__init__("tool schemas refused")
        self.body, self.note = body, note


@dataclass
class Call:
    """One client call as the steps share it: what came in, and who answers."""

    endpoint: Endpoint
    headers: dict[str, str]
    size: int  # of the body as read
    body: dict[str, Any]  # parsed, as the client sent it: every preset's rewrite starts from it
    blobs: Blobs
    ex: Exchange
    responder: Responder
    patience: float | None  # x-gateway-max-wait: how long the client waits for a load
    tools_json: ToolsJson | None = None  # the body's tool list serialised by the parse's walk
    image_parts: bool = True  # the walk saw a part naming an image type (or did not look)


class Proxy:
    """The request path: a client's ASGI call in, its answer out, its record to `ctx.record`."""

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
        self.frame = Frame(context, self.budget)
        self.prefixes = PrefixStep()
        self.schemas = tool_schemas.CleanLists()  # tool lists known to need no fix
        self.known_tools = KnownTools()  # what the body's walk found in tool lists it read before
        self.tool_images = ToolImages(context.describe)
        self.stored = StoredResponses(per_owner=context.settings.stored_per_key)

    async def handle(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        headers = scope.get("gateway.headers") or header_map(scope)  # read once, at the edge
        ex = self.frame.exchange(endpoint, scope, headers)
        responder = Responder(send, ex, endpoint.dialect, self.ctx.clock)
        link: ClientLink | None = scope.get("gateway.link")  # from the gateway's own server
        self.frame.begin()
        try:
            refused: Caught[GatewayError] | None = None
            try:
                arrived = link is not None and link.body_complete
                raw = await read_request(receive, headers, self.ctx.settings, arrived)
            except ClientGone:
                ex.outcome, ex.disconnect_phase = "client_disconnected", "reading"
                return
            except GatewayError as error:
                refused = Caught(error)
            if refused is not None:
                ex.outcome = "rejected"
                await responder.fail(refused.take())
                return
            steps = self._steps(endpoint, headers, raw, ex, responder)
            await self.frame.watched(receive, responder, self.frame.serve(responder, steps), link)
        finally:
            self.frame.end(ex)

    async def _steps(
        self,
        endpoint: Endpoint,
        headers: dict[str, str],
        raw: bytes | bytearray,
        ex: Exchange,
        responder: Responder,
    ) -> None:
        settings, fleet, team = self.ctx.settings, self.ctx.fleet(), self.ctx.team
        body, blobs, tokens, tools_json, image_parts, odd_types = await parse(raw, settings, self.known_tools)
        check_request(body, endpoint, odd_types)
        self.stored.refuse_foreign(body, ex.owner)
        responder.streaming = endpoint.streams and body.get("stream") is True
        responder.model = body.get("model")
        if settings.log_prompts:  # off by default: prompts are the users' data, not the operator's
            ex.prompt = body.get("messages", body.get("prompt", body.get("input")))
        found = route(fleet.table, endpoint, body, headers.get("x-task"), image_parts)
        preset, identity = found.preset, ex.identity
        ex.preset, ex.route = preset.name, found.reason
        team.check_preset(identity, preset.name)
        lowered = headers.get("x-gateway-priority", "").strip().lower() == "batch"
        ex.priority = "batch" if identity.priority == "batch" or lowered else "interactive"
        ex.estimated_tokens = tokens
        admission = await team.reserve(
            identity, preset.name, reservation(identity, tokens, body, endpoint, preset)
        )
        ticket: int | None = admission.ticket
        ex.admitted, ex.reservation = True, admission.reservation
        call = Call(
            endpoint,
            headers,
            len(raw),
            body,
            blobs,
            ex,
            responder,
            patience(headers),
            tools_json,
            image_parts,
        )
        forbidden = headers.get("x-gateway-fallback", "").strip().lower() == "none"
        ctx = self.ctx
        fallbacks = Fallbacks(
            fleet, preset, endpoint, identity, forbidden=forbidden, clock=ctx.clock, lifecycle=ctx.lifecycle
        )
        pool = fleet.pools[preset.name]
        ex.counted_tokens = await prompt_tokens(
            self.ctx.client, pool, endpoint, body, tokens, self.ctx.clock()
        )
        tokens = responder.input_tokens = ex.counted_tokens or tokens
        if (chosen := fallbacks.before_sending(ex, preset, tokens, call.patience)) is not preset:
            preset, ticket = chosen, None  # the shared ticket was the asked preset's position
        async with team.running(identity, preset.limits.queue_timeout, preset.limits.queue):
            while True:
                try:
                    await self._serve_preset(call, preset, ticket, tokens)
                    return
                except GatewayError as error:
                    if responder.started and not responder.opened:
                        raise  # a replica's answer started: nothing can take the request over
                    if isinstance(error, ContextExceeded) and error.prompt_tokens is not None:
                        tokens = error.prompt_tokens  # as the engine counted it in its refusal
                    target = fallbacks.after(ex, preset, error, tokens)
                    if target is None:
                        raise
                preset, ticket = target, None
                await responder.comment(f"fallback {ex.fallback}")

    async def _serve_preset(self, call: Call, preset: Preset, ticket: int | None, tokens: int) -> None:
        """Rewrite, prefix, attempts and relay, for one preset."""
        ex, endpoint = call.ex, call.endpoint
        table = self.ctx.fleet().table
        plan = rewrite(
            call.body, preset, endpoint, want_usage=True, schemas=self.schemas, tools_json=call.tools_json
        )
        # The rewrite makes no image part, so a body whose walk saw none has no tool-result image.
        if "tool_images" in preset.compat and call.image_parts:
            plan.notes += await self.tool_images.apply(
                plan.body, call.blobs, vision=preset.vision, can_describe=table.images is not None
            )
        server = server_tools.plan(call.body, endpoint.name, table.server_tools)
        if server is not None:
            server_tools.prepare(plan.body, server)
        ex.rewrites[:] = plan.notes
        ex.stream = plan.stream
        key = self.prefixes.apply(plan.body, ex, preset, call.headers, call.tools_json)
        attempt = self._attempt(call, preset, plan, ticket, tokens, key)
        if server is not None and table.server_tools is not None:
            await serve_rounds(
                self.dispatcher,
                self.ctx.settings,
                table.server_tools,
                call.responder,
                preset,
                plan,
                server,
                attempt,
            )
            return
        try:
            await self.send_and_relay(attempt, plan, call.responder)
            return
        except _Loosened as refusal:
            loosened, note = refusal.body, refusal.note  # retried after the handler (caught.py)
        # Once: the plan now says so, and the retry cannot raise it.
        plan.body, plan.loosened = loosened, True
        ex.rewrites.append(note)
        await self.send_and_relay(
            self._attempt(call, preset, plan, ticket, tokens, key), plan, call.responder
        )

    def _attempt(
        self, call: Call, preset: Preset, plan: Plan, ticket: int | None, tokens: int, key: str | None
    ) -> Attempt:
        attempt = Attempt(
            call.ex,
            self.ctx.fleet().pools[preset.name],
            call.endpoint,
            plan.body,
            call.size,
            self.ctx.clock() + preset.timeouts.read,
            key=key,
            blobs=call.blobs,
            forward=[(name, call.headers[name]) for name in call.endpoint.forward if name in call.headers],
            pinned=self.stored.holder(plan.body, preset.name, call.ex.owner),
            batch=call.ex.priority == "batch",
            shared_ticket=ticket,
            patience=call.patience,
            prompt_tokens=tokens,
            budget_explicit=plan.budget_explicit,
            context_stop=plan.context_stop,
            # The agent session `policy: session` places by (pipeline/session.py): digests only.
            session=session_of(plan.body, call.headers) if POLICIES[preset.policy].sessions else None,
        )
        if plan.stream:
            attempt.on_load_wait = functools.partial(call.responder.loading, preset.name)
        elif call.endpoint.streams and assembler_for(call.endpoint.name) is not None:
            attempt.as_stream = WHOLE_AS_STREAM
        return attempt

    async def send_and_relay(self, attempt: Attempt, plan: Plan, responder: Responder) -> None:
        ex, preset, settings = attempt.ex, attempt.pool.preset, self.ctx.settings
        loop = asyncio.get_running_loop()
        loop_deadline = loop.time() + preset.timeouts.read
        # A streaming client is kept connected while the request waits (relay/keepalive.py).
        keepalive = (
            KeepAlive(responder, settings.keepalive_after, settings.keepalive_every)
            if plan.stream and not responder.started
            else None
        )
        caught: Caught[BaseException] | None = None
        try:
            # One deadline for the whole answer, retries included.
            with Deadline(loop_deadline, loop):
                if preset.abort_on_disconnect:
                    response, replica = await self.dispatcher.open(attempt)
                else:
                    response, replica = await self.dispatcher.open_detachable(attempt, loop_deadline)
                await self._relay(attempt, plan, response, replica, responder, loop_deadline, keepalive)
        except BaseException as error:
            caught = Caught(error)
        if keepalive is not None:
            await keepalive.stop()
        if caught is not None and isinstance(caught.error, TimeoutError):
            caught.take()
            ex.outcome, ex.error_code = "upstream_error", "deadline_exceeded"
            message = f"No answer within the preset's deadline of {preset.timeouts.read:g} s"
            if not responder.started or responder.opened:
                raise GatewayTimeout(message, code="deadline_exceeded")
            if ex.stream:
                await responder.end(f"{message}; request {ex.request_id}", "deadline_exceeded")
        raise_again(caught)

    async def _relay(
        self,
        attempt: Attempt,
        plan: Plan,
        response: UpstreamResponse,
        replica: Replica,
        responder: Responder,
        loop_deadline: float,
        keepalive: KeepAlive | None,
    ) -> None:
        detach = False
        caught: Caught[BaseException] | None = None
        ex, settings = attempt.ex, self.ctx.settings
        # attempt.pool, not the pool it started in: a reload while it queued moves it to the new table's.
        preset = attempt.pool.preset
        try:
            if response.status >= 300:
                if keepalive is not None:
                    await keepalive.stop()
                key = replica.api_key()
                data = None
                if response.status == 400 and "tool_schemas" in preset.compat and not plan.loosened:
                    data = await response.read(ERROR_BODY_LIMIT)
                    message = tool_schemas.message_of(data)
                    loose = tool_schemas.loosen(plan.body, replica.engine, message)
                    if loose is not None:
                        raise _Loosened(*loose)
                await relay_replica_error(responder, response, (key,) if key else (), data)
            elif plan.stream:
                await relay_stream(
                    responder,
                    response,
                    drop_usage=plan.usage_injected,
                    write_timeout=settings.write_timeout,
                    changes=plan.changes,
                    keepalive=keepalive,
                    progress=replica.health.progress,
                    max_event=settings.max_event_bytes,
                )
            elif _is_stream(response) and (assembler := assembler_for(attempt.endpoint.name)) is not None:
                await relay_assembled(
                    responder, response, assembler, plan.changes, limit=settings.max_answer_bytes
                )
            else:
                await relay_whole(
                    responder,
                    response,
                    changes=plan.changes,
                    limit=settings.max_answer_bytes,
                    offload=settings.offload_bytes,
                )
        except UpstreamError as error:
            ex.outcome = "upstream_error"
            ex.upstream_errors.append(error.kind)
            caught = Caught(UpstreamFailure("The replica's answer broke off", code="upstream_disconnected"))
        except asyncio.CancelledError as cancelled:
            # A cancellation is the deadline, the client leaving or the server stopping; only the
            # last two may leave a detachable answer running.
            detach = not preset.abort_on_disconnect and asyncio.get_running_loop().time() < loop_deadline
            caught = Caught(cancelled)
        except BaseException as error:
            caught = Caught(error)
        if attempt.endpoint.stores and ex.answer.response_id:
            self.stored.remember(ex.answer.response_id, preset.name, replica.name, ex.owner)
        if ex.answer.prompt_tokens:
            replica.prompt_tokens += ex.answer.prompt_tokens
            replica.cached_tokens += ex.answer.cached_tokens or 0
        if detach:
            self.dispatcher.drain_later(response, attempt, replica, loop_deadline)
        else:
            await finish(response, attempt.release, replica)
        raise_again(caught)


def _is_stream(response: UpstreamResponse) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")
