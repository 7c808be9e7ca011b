"""The request path, in order; the one place that knows it.

    read body -> parse -> route -> rewrite -> pick -> admit (lease) -> send upstream
    (retrying on another replica only before the client saw a byte) -> relay -> record

A disconnect watcher runs beside each request: when the client leaves, in any phase, the work is
cancelled, and cancellation closes the upstream connection so the replica stops generating.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from gateway import relay
from gateway.body import ClientGone, has_images, parse_object, read_body
from gateway.errors import (
    GatewayBug,
    GatewayError,
    GatewayTimeout,
    NoUpstream,
    UpstreamFailure,
    UpstreamServerError,
)
from gateway.exchange import Exchange
from gateway.health import Outcome
from gateway.replicas import Fleet, Pool, Replica
from gateway.rewrite import Endpoint, cap_to_context, check_request, requested_task, rewrite
from gateway.settings import Settings
from gateway.upstream import (
    ConnectFailed,
    HeaderTimeout,
    Reset,
    Timeouts,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Recorder = Callable[[Exchange], None]

UPSTREAM_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
RETRYABLE_STATUS = (502, 503, 504)
MAX_RETRY_AFTER_WAIT = 10.0


class RetryableStatus(UpstreamError):
    kind = "retryable_status"

    def __init__(self, status: int, body: bytes, retry_after: float | None) -> None:
        super().__init__(f"replica answered {status}")
        self.status, self.body, self.retry_after = status, body, retry_after


_RETRYABLE = (ConnectFailed, Reset, HeaderTimeout, RetryableStatus)


class RetryBudget:
    """Retries in flight stay under max(min_concurrent, ratio x requests in flight) (Envoy's budget)."""

    def __init__(self) -> None:
        self.active = 0
        self.retrying = 0

    def allow(self, ratio: float, min_concurrent: int) -> bool:
        return self.retrying < max(min_concurrent, ratio * self.active)


@dataclass
class Context:
    """What the request path needs from the running gateway."""

    settings: Settings
    fleet: Callable[[], Fleet]
    client: UpstreamClient
    record: Recorder
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    clock: Callable[[], float] = time.monotonic


class Proxy:
    def __init__(self, context: Context) -> None:
        self.ctx = context
        self.budget = RetryBudget()

    def endpoint(self, endpoint: Endpoint) -> _Endpoint:
        return _Endpoint(self, endpoint)

    async def handle(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        headers = _headers(scope)
        client = scope.get("client")
        ex = Exchange(
            request_id=_request_id(headers.get("x-request-id")),
            endpoint=endpoint,
            started=self.ctx.clock(),
            client=client[0] if client else "",
        )
        self.budget.active += 1
        try:
            await self._handle(endpoint, headers, ex, receive, send)
        finally:
            self.budget.active -= 1
            if ex.attempts > 1:
                self.budget.retrying -= 1
            if ex.finished is None:
                ex.finished = self.ctx.clock()
            self.ctx.record(ex)

    async def _handle(
        self, endpoint: Endpoint, headers: dict[str, str], ex: Exchange, receive: Receive, send: Send
    ) -> None:
        settings = self.ctx.settings
        try:
            raw = await read_body(
                receive, _content_length(headers), settings.max_body_bytes, settings.body_timeout
            )
        except ClientGone:
            ex.outcome, ex.disconnect_phase = "client_disconnected", "reading"
            return
        except GatewayError as error:
            ex.outcome = "rejected"
            await relay.send_error(send, ex, error)
            return
        work = asyncio.ensure_future(self._serve(endpoint, headers, raw, ex, send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                # The client left: cancelling the work closes the upstream connection.
                ex.outcome = "client_disconnected"
                ex.disconnect_phase = "streaming" if ex.headers_sent else "waiting"
                work.cancel()
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                await work
            with suppress(asyncio.CancelledError):
                await watcher

    async def _serve(
        self, endpoint: Endpoint, headers: dict[str, str], raw: bytes, ex: Exchange, send: Send
    ) -> None:
        try:
            await self._route_and_relay(endpoint, headers, raw, ex, send)
        except GatewayError as error:
            if ex.headers_sent:
                raise GatewayBug("error after the response started") from error
            ex.outcome = "upstream_error" if ex.attempts else "rejected"
            await relay.send_error(send, ex, error)

    async def _route_and_relay(
        self, endpoint: Endpoint, headers: dict[str, str], raw: bytes, ex: Exchange, send: Send
    ) -> None:
        settings, fleet = self.ctx.settings, self.ctx.fleet()
        body = await self._offload(len(raw), parse_object, raw, settings.max_json_depth)
        check_request(body, endpoint)
        task = requested_task(body, headers.get("x-task"))
        route = fleet.table.resolve(body.get("model"), task, endpoint == "chat" and has_images(body))
        preset = route.preset
        ex.preset, ex.route = preset.name, route.reason
        plan = rewrite(body, preset, endpoint, want_usage=True)
        ex.rewrites.extend(plan.notes)
        ex.stream = plan.stream
        pool = fleet.pools[preset.name]
        deadline = self.ctx.clock() + preset.timeouts.read
        try:
            async with asyncio.timeout_at(_loop_time(deadline, self.ctx.clock)):
                response, replica = await self._open(ex, pool, endpoint, body, len(raw), deadline)
        except TimeoutError:
            raise GatewayTimeout(
                f"No answer within the preset's deadline of {preset.timeouts.read:g} s",
                code="deadline_exceeded",
            ) from None
        try:
            if response.status >= 300:
                await self._relay_status(ex, replica, response, send)
            elif plan.stream:
                await relay.send_stream(
                    send,
                    ex,
                    response,
                    drop_usage=plan.usage_injected,
                    deadline=_loop_time(deadline, self.ctx.clock),
                    clock=self.ctx.clock,
                )
            else:
                async with asyncio.timeout_at(_loop_time(deadline, self.ctx.clock)):
                    await relay.send_whole(send, ex, response, self.ctx.clock)
        except TimeoutError:
            raise GatewayTimeout(
                "The answer did not finish within the deadline", code="deadline_exceeded"
            ) from None
        except UpstreamError as error:
            ex.upstream_errors.append(error.kind)
            raise UpstreamFailure("The replica's answer broke off", code="upstream_disconnected") from None
        finally:
            await response.close()
            pool.release(replica)

    async def _relay_status(
        self, ex: Exchange, replica: Replica, response: UpstreamResponse, send: Send
    ) -> None:
        data = await response.read(relay.ERROR_BODY_LIMIT)
        if response.status < 400:
            raise UpstreamFailure("The replica answered with a redirect, which the gateway does not follow")
        if response.status >= 500:
            raise UpstreamServerError(
                f"The replica failed to answer (HTTP {response.status}); request {ex.request_id}"
            )
        body = relay.upstream_error_body(response.status, data, ex.request_id)
        ex.status, ex.outcome = response.status, "completed"
        ex.error_code = str(response.status)
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *relay.gateway_headers(ex),
                ],
            }
        )
        ex.headers_sent = True
        await send({"type": "http.response.body", "body": body})

    async def _open(
        self,
        ex: Exchange,
        pool: Pool,
        endpoint: Endpoint,
        body: dict[str, Any],
        size: int,
        deadline: float,
    ) -> tuple[UpstreamResponse, Replica]:
        retries = pool.preset.retries
        tried: list[str] = []
        encoded: dict[int | None, tuple[bytes, tuple[str, str] | None]] = {}
        ticket = pool.ticket()

        def stop(state: RetryCallState) -> bool:
            if state.attempt_number >= retries.attempts or self.ctx.clock() >= deadline:
                return True
            return ex.attempts <= 1 and not self.budget.allow(retries.budget, retries.min_concurrent)

        def wait(state: RetryCallState) -> float:
            # Retry-After binds the replica that sent it; another ready replica needs no wait.
            error = state.outcome.exception() if state.outcome else None
            after = error.retry_after if isinstance(error, RetryableStatus) else None
            untried = pool.pick(ticket, exclude=tried).order
            if after is None or any(_available(pool, name) for name in untried):
                return 0.0
            return max(0.0, min(after, MAX_RETRY_AFTER_WAIT, deadline - self.ctx.clock()))

        def before_sleep(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            ex.retries.append(error.kind if isinstance(error, UpstreamError) else "error")
            if ex.attempts == 1:
                self.budget.retrying += 1

        retrying = AsyncRetrying(
            stop=stop,
            wait=wait,
            retry=retry_if_exception_type(_RETRYABLE),
            sleep=self.ctx.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._attempt(
                        ex, pool, endpoint, body, size, encoded, tried, ticket, deadline
                    )
        except RetryableStatus as error:
            raise _final_status(error, ex) from None
        except ConnectFailed:
            raise NoUpstream(
                f"No replica of preset '{pool.preset.name}' could be reached", headers={"retry-after": "5"}
            ) from None
        except HeaderTimeout:
            raise GatewayTimeout("The replica sent no response headers in time") from None
        except UpstreamError as error:
            raise UpstreamFailure(
                f"The replica closed the connection without an answer; request {ex.request_id}",
                code="upstream_" + error.kind,
            ) from None
        raise GatewayBug("retry loop ended without an outcome")  # pragma: no cover

    async def _attempt(
        self,
        ex: Exchange,
        pool: Pool,
        endpoint: Endpoint,
        body: dict[str, Any],
        size: int,
        encoded: dict[int | None, tuple[bytes, tuple[str, str] | None]],
        tried: list[str],
        ticket: int,
        deadline: float,
    ) -> tuple[UpstreamResponse, Replica]:
        pick = pool.pick(ticket, exclude=tried)
        if not pick.order:
            pick = pool.pick(ticket)  # every replica tried once: go round again
        if not ex.pick_reason:
            ex.pick_reason = pick.reason
        if not pick.order:
            raise NoUpstream(f"Preset '{pool.preset.name}' has no replicas", headers={"retry-after": "5"})
        replica = await pool.admit(pick, deadline)
        tried.append(replica.name)
        ex.replica, ex.engine = replica.name, replica.engine
        ex.attempts += 1
        try:
            data, note = await self._encode(body, size, replica.context, encoded)
            if note is not None and note not in ex.rewrites:
                ex.rewrites.append(note)
            timeouts = pool.preset.timeouts
            ex.upstream_sent = ex.upstream_sent or self.ctx.clock()
            response = await self.ctx.client.send(
                replica.url + UPSTREAM_PATHS[endpoint],
                _upstream_headers(ex, replica),
                data,
                Timeouts(
                    connect=timeouts.connect,
                    first_byte=timeouts.first_byte if ex.stream else None,
                    idle=timeouts.idle if ex.stream else None,
                ),
            )
        except UpstreamError as error:
            pool.release(replica)
            self._outcome(
                ex, replica, "connect_error" if isinstance(error, ConnectFailed | Reset) else "server_error"
            )
            ex.upstream_errors.append(error.kind)
            ex.failed_replica = replica.name
            raise
        except BaseException:
            pool.release(replica)
            raise
        if response.status in RETRYABLE_STATUS:
            try:
                detail = await response.read(relay.ERROR_BODY_LIMIT)
            except UpstreamError:
                detail = b""
            finally:
                await response.close()
                pool.release(replica)
            self._outcome(ex, replica, "server_error")
            ex.upstream_errors.append(f"status_{response.status}")
            ex.failed_replica = replica.name
            raise RetryableStatus(response.status, detail, _retry_after(response.headers.get("retry-after")))
        status = response.status
        self._outcome(
            ex, replica, "server_error" if status >= 500 else "client_error" if status >= 400 else "success"
        )
        return response, replica

    def _outcome(self, ex: Exchange, replica: Replica, outcome: Outcome) -> None:
        if replica.health.on_outcome(outcome, self.ctx.clock()):
            ex.warnings.append(f"ejected {replica.name}")

    async def _encode(
        self,
        body: dict[str, Any],
        size: int,
        context: int | None,
        cache: dict[int | None, tuple[bytes, tuple[str, str] | None]],
    ) -> tuple[bytes, tuple[str, str] | None]:
        if context not in cache:
            capped, note = cap_to_context(body, context)
            cache[context] = (await self._offload(size, orjson.dumps, capped), note)
        return cache[context]

    async def _offload(self, size: int, func: Callable[..., Any], *args: Any) -> Any:
        """Large bodies are parsed and serialised on a thread so other requests keep flowing."""
        if size > self.ctx.settings.offload_bytes:
            return await asyncio.to_thread(func, *args)
        return func(*args)


class _Endpoint:
    """A raw ASGI app (Starlette's Route passes scope, receive and send straight through to it)."""

    def __init__(self, proxy: Proxy, endpoint: Endpoint) -> None:
        self.proxy, self.endpoint = proxy, endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.proxy.handle(self.endpoint, scope, receive, send)


def _final_status(error: RetryableStatus, ex: Exchange) -> GatewayError:
    headers = {"retry-after": str(int(error.retry_after or 1))}
    if error.status == 503:
        return NoUpstream(
            f"Every replica tried was unavailable (HTTP 503); request {ex.request_id}",
            code="upstream_unavailable",
            headers=headers,
        )
    if error.status == 504:
        return GatewayTimeout(f"The replica timed out (HTTP 504); request {ex.request_id}")
    return UpstreamFailure(f"The replica answered HTTP 502; request {ex.request_id}", code="bad_gateway")


def _available(pool: Pool, name: str) -> bool:
    replica = pool.get(name)
    return replica is not None and replica.health.available(pool.clock())


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: treat as absent rather than parse clocks we do not share


def _upstream_headers(ex: Exchange, replica: Replica) -> list[tuple[str, str]]:
    # Nothing of the client's headers is forwarded: not its credentials, not hop-by-hop or proxy
    # headers, not a forged X-Forwarded-For. The replica sees the gateway's own set only.
    headers = [("content-type", "application/json"), ("x-request-id", ex.request_id)]
    if ex.client:
        headers.append(("x-forwarded-for", ex.client))
    key = replica.api_key()
    if key:
        headers.append(("authorization", f"Bearer {key}"))
    if ex.stream:
        headers.append(("accept", "text/event-stream"))
    return headers


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def _content_length(headers: dict[str, str]) -> int | None:
    value = headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None


def _request_id(value: str | None) -> str:
    return value if value is not None and _REQUEST_ID.match(value) else uuid.uuid4().hex


def _loop_time(deadline: float, clock: Callable[[], float]) -> float:
    """Convert a deadline on the gateway's clock to the event loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - clock())


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
