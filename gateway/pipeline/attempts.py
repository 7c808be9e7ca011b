"""Upstream attempts for one request: pick, admit, send, and retry on another replica.

Retries happen only here, before the client has seen a byte, and only on failures that prove the
answer never started: connect errors, a connection closed before response headers, no headers
within the first-byte timeout, and 502/503/504. Never on other 4xx or on 500 (a 500 is often
deterministic: a template that cannot render). A retry budget keeps a storm from multiplying load.
The first attempt runs outside tenacity, so the common case costs nothing for retries it never makes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from gateway.answers.context_stop import ContextStop
from gateway.caught import Caught, raise_again
from gateway.dialects.messages_chat import CHAT_PATH, ChatStreamAsMessages, messages_to_chat
from gateway.dialects.registry import Endpoint
from gateway.errors import GatewayBug, GatewayError, GatewayTimeout, NoUpstream, UpstreamFailure
from gateway.fleet.health import Outcome
from gateway.fleet.prober import read_slots
from gateway.fleet.replicas import Pool, PoolRetired, Replica
from gateway.fleet.slots import PINNED_ENDPOINTS, SlotPlan
from gateway.ops.exchange import Exchange
from gateway.pipeline.blobs import Blobs, put_back
from gateway.pipeline.rewrite import cap_to_context
from gateway.pipeline.session import Session, digest
from gateway.relay.replica_errors import ERROR_BODY_LIMIT
from gateway.routing.balancer import POLICIES, Pick, retry_order
from gateway.types import ReadBytes
from gateway.upstream import (
    ConnectFailed,
    HeaderTimeout,
    Reset,
    Timeouts,
    UpstreamClient,
    UpstreamError,
    UpstreamResponse,
)
from gateway.upstream.transcoded import Transcoded

RETRYABLE_STATUS = (502, 503, 504)
SESSION_WAITS = frozenset({"session_home", "session_new", "session_moved"})
MAX_RETRY_AFTER_WAIT = 10.0


class RetryableStatus(UpstreamError):
    kind = "retryable_status"

    def __init__(self, status: int, body: ReadBytes, retry_after: float | None) -> None:
        super().__init__(f"replica answered {status}")
        self.status, self.body, self.retry_after = status, body, retry_after


RETRYABLE = (ConnectFailed, Reset, HeaderTimeout, RetryableStatus)


class RetryBudget:
    """Requests retrying stay under max(min_concurrent, ratio x requests in flight), after Envoy's
    retry budget; a request counts as retrying until a retry gets an answer or gives up."""

    def __init__(self) -> None:
        self.active = 0
        self.retrying = 0

    def allow(self, ratio: float, min_concurrent: int) -> bool:
        return self.retrying < max(min_concurrent, ratio * self.active)


@dataclass
class Attempt:
    """One request's attempts: its own state, shared by the first try and the retries."""

    ex: Exchange
    pool: Pool
    endpoint: Endpoint
    body: dict[str, Any]
    size: int
    deadline: float
    key: str | None = None
    tried: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # replicas that refused the connection
    # The serialised body per (context cap, sent as a stream, slot, sent as chat): replicas differ
    # in all four.
    encoded: dict[tuple[int | None, bool, int | None, bool], tuple[bytes, tuple[str, str] | None]] = field(
        default_factory=dict
    )
    ticket: int = 0
    blobs: Blobs = field(default_factory=Blobs)  # long strings set aside unparsed (blobs.py)
    forward: list[tuple[str, str]] = field(default_factory=list)  # client headers the endpoint reads
    pinned: str | None = None  # the one replica that holds what this request refers to
    method: str = "POST"
    path: str | None = None  # the upstream path when it is the client's own (a stored response)
    # Called while a launched replica starts for this request (a stream's `: loading` comments).
    on_load_wait: Callable[[float], Awaitable[None]] | None = None
    batch: bool = False  # batch priority: queues behind interactive work, within the batch share
    # The round-robin position, when the team's counters gave one (shared between gateways).
    shared_ticket: int | None = None
    patience: float | None = None  # the client's own limit on a load wait (x-gateway-max-wait)
    prompt_tokens: int | None = None  # counted or estimated: the budget is capped to what it leaves
    budget_explicit: bool = True  # the client chose its budget (else the preset's default was set)
    context_stop: ContextStop | None = None  # armed when this attempt's budget is lowered to the context
    # Engines that get a whole-answer request as a stream (registry.WHOLE_AS_STREAM), the answer
    # then assembled by the gateway; empty when the client streams or the endpoint cannot.
    as_stream: frozenset[str] = frozenset()
    # The agent session (pipeline/session.py): `policy: session` places by it and keeps its slot.
    session: Session | None = None
    placed: dict[str, SlotPlan] = field(default_factory=dict)  # replica -> its attempt's slot plan

    def release(self, replica: Replica) -> None:
        self.pool.release(replica, self.batch)
        plan = self.placed.pop(replica.name, None)
        if plan is not None and self.session is not None:
            # The answer's counts correct the replica's cache picture (fleet/slots.py).
            answer = self.ex.answer
            replica.cache.settle(
                self.session.key,
                plan,
                answer.prompt_tokens,
                answer.cached_tokens,
                answer.completion_tokens,
                self.pool.clock(),
            )

    def unfit(self) -> list[str]:
        """Replicas this request must never reach: an engine without the endpoint, or any
        replica but the pinned one."""
        return [
            r.name
            for r in self.pool.replicas
            if not self.endpoint.serves(r.engine) or (self.pinned is not None and r.name != self.pinned)
        ]


class Lifecycle(Protocol):
    """What the request path needs from the supervisor of launched replicas (fleet/supervisor.py)."""

    async def ensure(
        self, pool: Pool, deadline: float, notify: Callable[[float], Awaitable[None]] | None = None
    ) -> float: ...

    def unavailable(self, pool: Pool) -> list[str]: ...

    def outlook(self, pool: Pool) -> tuple[bool, bool, float | None]: ...


class Dispatcher:
    def __init__(
        self,
        client: UpstreamClient,
        budget: RetryBudget,
        offload_bytes: int,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        pools: Callable[[str], Pool | None] = lambda name: None,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self.pools = pools  # a preset's pool in the current table (it changes on reload)
        self.lifecycle = lifecycle
        self.client = client
        self.budget = budget
        self.offload_bytes = offload_bytes
        self.sleep = sleep
        self.clock = clock
        self._background: set[asyncio.Future[None]] = set()  # answers draining for nobody

    async def open(self, attempt: Attempt) -> tuple[UpstreamResponse, Replica]:
        attempt.ticket = attempt.pool.ticket() if attempt.shared_ticket is None else attempt.shared_ticket
        try:
            # Retried after the handler, not in it: no await in one (caught.py).
            try:
                return await self._try(attempt)
            except RETRYABLE as error:
                caught = Caught(error)
            retries = attempt.pool.preset.retries
            if retries.attempts < 2 or not self.budget.allow(retries.budget, retries.min_concurrent):
                raise_again(caught)
            wait = self._wait_after(caught.error, attempt)
            kind = caught.take().kind  # let go of: it holds this frame (caught.py)
            # Counted while retrying, not for the whole answer: a retried stream that got its
            # headers is an ordinary request again, and minutes-long streams must not use
            # up the budget a replica's crash needs.
            self.budget.retrying += 1
            try:
                attempt.ex.retries.append(kind)
                await self.sleep(wait)
                return await self._retry(attempt, retries.attempts - 1)
            finally:
                self.budget.retrying -= 1
        except UpstreamError as error:
            raise _final_error(error, attempt) from None

    async def _retry(self, attempt: Attempt, remaining: int) -> tuple[UpstreamResponse, Replica]:
        def before_sleep(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            attempt.ex.retries.append(error.kind if isinstance(error, UpstreamError) else "error")

        def wait(state: RetryCallState) -> float:
            error = state.outcome.exception() if state.outcome else None
            return self._wait_after(error, attempt)

        def stop(state: RetryCallState) -> bool:
            return state.attempt_number >= remaining or self.clock() >= attempt.deadline

        retrying = AsyncRetrying(
            stop=stop,
            wait=wait,
            retry=retry_if_exception_type(RETRYABLE),
            sleep=self.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        async for each in retrying:
            with each:
                return await self._try(attempt)
        raise AssertionError("unreachable: tenacity reraises the last error")  # pragma: no cover

    def _wait_after(self, error: BaseException | None, attempt: Attempt) -> float:
        # Retry-After binds the replica that sent it; another available replica needs no wait.
        after = error.retry_after if isinstance(error, RetryableStatus) else None
        if after is None:
            return 0.0
        pool = attempt.pool
        now = self.clock()
        for name in pool.pick(attempt.ticket, exclude=attempt.tried).order:
            replica = pool.get(name)
            if replica is not None and replica.health.available(now):
                return 0.0
        return max(0.0, min(after, MAX_RETRY_AFTER_WAIT, attempt.deadline - now))

    def _repool(self, attempt: Attempt) -> None:
        """A reload replaced the pool this request queued in: the same preset in the new table, with
        its served model name; nothing was sent yet, so nothing else changes."""
        name = attempt.pool.preset.name
        pool = self.pools(name)
        if pool is None:
            raise NoUpstream(
                f"Preset '{name}' was removed by a reload of the routing table", headers={"retry-after": "5"}
            )
        attempt.pool = pool
        if attempt.body.get("model") is not None:
            attempt.body["model"] = pool.preset.served_model
        attempt.encoded.clear()
        attempt.tried = [n for n in attempt.tried if pool.get(n) is not None]
        attempt.refused = [n for n in attempt.refused if pool.get(n) is not None]

    async def _try(self, attempt: Attempt) -> tuple[UpstreamResponse, Replica]:
        pool, ex = attempt.pool, attempt.ex
        stopped: list[str] = []
        if self.lifecycle is not None:
            # A preset whose launched replicas are all stopped starts one and waits for it, within
            # `timeouts.load`; a retry finds it starting or ready and never starts a second.
            patience = pool.preset.timeouts.load if attempt.patience is None else attempt.patience
            load_deadline = min(attempt.deadline, self.clock() + patience)
            waited = await self.lifecycle.ensure(pool, load_deadline, attempt.on_load_wait)
            if waited:
                ex.load_wait = (ex.load_wait or 0.0) + waited
            stopped = self.lifecycle.unavailable(pool)  # never picked, not even by panic routing
        # A replica that refused this request's connection is not asked again by it.
        exclude = [*attempt.refused, *attempt.unfit(), *stopped]
        session = _session(attempt)
        if session is not None:
            await self._fresh_slots(pool)
        pick = pool.pick(
            attempt.ticket,
            attempt.key,
            exclude=exclude,
            session=session.key if session is not None else None,
            group=session.group if session is not None else None,
            tokens=attempt.prompt_tokens or 0,
        )
        if attempt.tried:
            suspects = [r.name for r in pool.replicas if r.health.connect_fail_streak]
            pick = retry_order(pick, attempt.tried, suspects)
        if not pick.order:
            raise NoUpstream(f"Preset '{pool.preset.name}' has no replicas", headers={"retry-after": "5"})
        ex.pick_reason = ex.pick_reason or pick.reason
        waits_for = _waits_for(pool, pick, session, attempt)
        if waits_for is not None and session is not None:
            # The session's place was chosen by cost, its wait there included: it waits for that
            # replica rather than take a free place elsewhere and prefill its whole prompt again.
            pick = Pick((waits_for.name,), pick.reason)
            waits_for.waiting += 1
            waits_for.cache.arrive(session.key)
        queued = self.clock()
        admitted: Replica | None = None
        try:
            admitted = await pool.admit(pick, attempt.deadline, attempt.batch)
        except PoolRetired:
            pass
        finally:
            ex.queue_wait = (ex.queue_wait or 0.0) + (self.clock() - queued)
            if waits_for is not None and session is not None:
                waits_for.waiting -= 1
                waits_for.cache.arrived(session.key)
        if admitted is None:  # its pool was retired by a reload while it queued
            self._repool(attempt)
            return await self._try(attempt)
        replica = admitted
        attempt.tried.append(replica.name)
        ex.replica, ex.engine = replica.name, replica.engine
        streamed = ex.stream or replica.engine in attempt.as_stream
        ex.upstream_stream = streamed
        as_chat = streamed and session is not None and replica.engine in attempt.endpoint.as_chat
        ex.upstream_as_chat = as_chat
        slot = self._place(attempt, session, replica, as_chat)
        try:
            data = await self._encode(attempt, replica.context, streamed and not ex.stream, slot, as_chat)
        except GatewayError:
            attempt.release(replica)  # the request does not fit this replica (its context)
            raise
        except Exception as exc:
            # The gateway's own failure, before anything left: the same on every replica, so not
            # retried, and no attempt was made.
            attempt.release(replica)
            raise GatewayBug(f"The gateway could not prepare the request; request {ex.request_id}") from exc
        ex.attempts += 1
        ex.upstream_sent = ex.upstream_sent or self.clock()
        try:
            path = CHAT_PATH if as_chat else attempt.path or attempt.endpoint.upstream[replica.engine]
            response = await self.client.send(
                replica.url + path,
                upstream_headers(ex, replica, attempt.forward, with_body=bool(data)),
                data,
                _timeouts(pool, streamed),
                attempt.method,
            )
        except UpstreamError as error:
            attempt.release(replica)
            if isinstance(error, ConnectFailed):
                attempt.refused.append(replica.name)
            self._failed(
                ex,
                replica,
                error.kind,
                "connect_error" if isinstance(error, ConnectFailed | Reset) else "server_error",
            )
            raise
        except BaseException:
            attempt.release(replica)
            raise
        status = response.status
        if status in RETRYABLE_STATUS:
            detail: ReadBytes = b""
            caught: Caught[BaseException] | None = None
            try:
                detail = await response.read(ERROR_BODY_LIMIT)
            except UpstreamError:
                pass
            except BaseException as error:
                caught = Caught(error)
            await response.close()
            attempt.release(replica)
            raise_again(caught)
            self._failed(ex, replica, f"status_{status}", "server_error")
            raise RetryableStatus(status, detail, _retry_after(response.headers.get("retry-after")))
        outcome: Outcome = "server_error" if status >= 500 else "client_error" if status >= 400 else "success"
        replica.health.on_outcome(outcome, self.clock())
        ex.path.append(f"{replica.name}:{status}")
        if as_chat:
            return Transcoded(response, ChatStreamAsMessages()), replica
        return response, replica

    async def _fresh_slots(self, pool: Pool) -> None:
        """Before a session is placed: llama-server replicas where the engine chose a slot since the
        last look are read again (GET /slots), so that no session is pinned to a slot it lost."""
        stale = [r for r in pool.replicas if r.engine == "llamacpp" and r.cache.stale]
        if stale:
            await asyncio.gather(*(read_slots(self.client, r) for r in stale))

    def _place(
        self, attempt: Attempt, session: Session | None, replica: Replica, as_chat: bool = False
    ) -> int | None:
        """The slot this attempt pins on `replica` (None: the engine chooses), noted in its picture."""
        if session is None:
            return None
        if replica.engine == "llamacpp":
            pinnable = as_chat or attempt.endpoint.name in PINNED_ENDPOINTS
            plan = replica.cache.plan(session.key, pinnable=pinnable, transient=session.transient)
        else:
            plan = SlotPlan(None, "shared")  # vLLM: one block cache, no slots
        replica.cache.begin(session.key, session.group, plan, self.clock())
        attempt.placed[replica.name] = plan
        return plan.slot

    async def open_detachable(
        self, attempt: Attempt, loop_deadline: float
    ) -> tuple[UpstreamResponse, Replica]:
        """For engines that mishandle aborts (`abort_on_disconnect: false`): a client that leaves
        before the answer starts does not cancel the replica's work; it runs on, unread."""

        async def open_by_deadline() -> tuple[UpstreamResponse, Replica]:
            async with asyncio.timeout_at(loop_deadline):
                return await self.open(attempt)

        opening = asyncio.ensure_future(open_by_deadline())
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:

            def finish(done: asyncio.Future[tuple[UpstreamResponse, Replica]]) -> None:
                if not done.cancelled() and done.exception() is None:
                    response, replica = done.result()
                    self.drain_later(response, attempt, replica, loop_deadline)

            opening.add_done_callback(finish)
            raise

    def drain_later(
        self, response: UpstreamResponse, attempt: Attempt, replica: Replica, loop_deadline: float
    ) -> None:
        """Let the replica finish an answer nobody reads (within the deadline), then free its place."""
        self._detach(_drain(response, attempt.release, replica, loop_deadline))

    def _detach(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _failed(self, ex: Exchange, replica: Replica, kind: str, outcome: Outcome) -> None:
        ex.upstream_errors.append(kind)
        ex.path.append(f"{replica.name}:{kind}")
        ex.failed_replica = replica.name
        if replica.health.on_outcome(outcome, self.clock()):
            ex.ejected.append(replica.name)
            ex.warnings.append(("ejected", f"replica {replica.name} taken out of rotation"))

    async def _encode(
        self,
        attempt: Attempt,
        context: int | None,
        as_stream: bool,
        slot: int | None = None,
        as_chat: bool = False,
    ) -> bytes:
        """Serialise once per distinct context cap, form, slot and upstream dialect; large bodies
        on a thread."""
        if attempt.method != "POST" or attempt.path is not None:
            return b""
        key = (context, as_stream, slot, as_chat)
        if key not in attempt.encoded:
            capped, note = cap_to_context(
                attempt.body, context, attempt.endpoint, attempt.prompt_tokens, attempt.budget_explicit
            )
            if as_chat:
                capped = messages_to_chat(capped)  # asks for its stream itself
            elif as_stream:
                capped = {**capped, **stream_fields(attempt.endpoint)}
            if slot is not None:
                # llama-server runs the request in this slot, which holds the session's prompt.
                capped = {**capped, "id_slot": slot}
            if attempt.size > self.offload_bytes:
                data = await asyncio.to_thread(_serialise, capped, attempt.blobs)
            else:
                data = orjson.dumps(capped)
            attempt.encoded[key] = (data, note)
        data, note = attempt.encoded[key]
        if attempt.context_stop is not None:
            attempt.context_stop.arm(note is not None)
        if note is not None and note not in attempt.ex.rewrites:
            attempt.ex.rewrites.append(note)
        return data


def _waits_for(pool: Pool, pick: Pick, session: Session | None, attempt: Attempt) -> Replica | None:
    """The one replica a session's first attempt waits for, when placement chose it (a retry, or a
    pick that gave way to bounded load, may take any)."""
    if session is None or attempt.tried or pick.reason not in SESSION_WAITS or not pick.order:
        return None
    return pool.get(pick.order[0])


def _session(attempt: Attempt) -> Session | None:
    """The session `policy: session` places by: the one the request path named, else the
    affinity key (the session header or the conversation's start) as a session of its own."""
    if not POLICIES[attempt.pool.preset.policy].sessions:
        return None
    if attempt.session is not None:
        return attempt.session
    if not attempt.key:
        return None
    key = digest("key", attempt.key)
    attempt.session = Session(key, key, "key")
    return attempt.session


async def _drain(
    response: UpstreamResponse, release: Callable[[Replica], None], replica: Replica, loop_deadline: float
) -> None:
    caught: Caught[BaseException] | None = None
    try:
        async with asyncio.timeout_at(loop_deadline):
            async for _ in response.chunks():
                pass
    except (TimeoutError, UpstreamError):
        pass
    except BaseException as error:
        caught = Caught(error)
    await finish(response, release, replica)
    raise_again(caught)


async def finish(response: UpstreamResponse, release: Callable[[Replica], None], replica: Replica) -> None:
    """Close the replica's answer (aborting it when unread) and give its place back."""
    try:
        await response.close()
    finally:
        release(replica)


def stream_fields(endpoint: Endpoint) -> dict[str, Any]:
    """What turns a whole-answer request into a streaming one on `endpoint`: chat and completions
    also ask for the usage chunk, which the whole answer reports."""
    if endpoint.dialect.done is not None:  # the OpenAI chat and completions streams
        return {"stream": True, "stream_options": {"include_usage": True}}
    return {"stream": True}


def _serialise(body: dict[str, Any], blobs: Blobs) -> bytes:
    return put_back(orjson.dumps(body), blobs)


def upstream_headers(
    ex: Exchange, replica: Replica, forward: list[tuple[str, str]] | None = None, with_body: bool = True
) -> list[tuple[str, str]]:
    # Of the client's headers only those its endpoint's engines read are forwarded (the Anthropic
    # version and betas): not its credentials, not hop-by-hop or proxy headers, not a forged
    # X-Forwarded-For. The replica sees the gateway's own set otherwise.
    headers = [("x-request-id", ex.request_id), *(forward or ())]
    if with_body:
        headers.insert(0, ("content-type", "application/json"))
    if ex.client:
        headers.append(("x-forwarded-for", ex.client))
    key = replica.api_key()
    if key:
        headers.append(("authorization", f"Bearer {key}"))
    if ex.upstream_stream:  # the client's stream, or a whole answer asked for as one (assembled)
        headers.append(("accept", "text/event-stream"))
        if replica.engine == "llamacpp":
            # llama-server advertises keep-alive on a stream and then closes the connection after
            # it; reused at once, such a connection fails the next request before its headers
            # (measured: 19 of 96 assembled answers reset and retried elsewhere without this).
            headers.append(("connection", "close"))
    return headers


def _timeouts(pool: Pool, stream: bool) -> Timeouts:
    # A non-streaming answer sends its headers only when generation ends, minutes later: it is
    # bounded by the overall deadline, not by a header or idle timeout.
    timeouts = pool.preset.timeouts
    if stream:
        return Timeouts(connect=timeouts.connect, first_byte=timeouts.first_byte, idle=timeouts.idle)
    return Timeouts(connect=timeouts.connect, first_byte=None, idle=None)


MAX_RETRY_AFTER = 3600.0  # what a replica may ask for, at most, in the Retry-After passed on


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date: treated as absent rather than trusting a clock we do not share
    if not math.isfinite(seconds):
        # `inf` parses as a float; passed on, int() of it raised and turned a 503 into a 500.
        return None if math.isnan(seconds) else MAX_RETRY_AFTER
    return min(max(0.0, seconds), MAX_RETRY_AFTER)


def _final_error(error: UpstreamError, attempt: Attempt) -> GatewayError:
    request_id, preset = attempt.ex.request_id, attempt.pool.preset.name
    if isinstance(error, RetryableStatus):
        headers = {"retry-after": str(max(1, int(error.retry_after or 1)))}
        if error.status == 503:
            return NoUpstream(
                f"Every replica tried was unavailable (HTTP 503); request {request_id}",
                code="upstream_unavailable",
                headers=headers,
            )
        if error.status == 504:
            return GatewayTimeout(f"The replica timed out (HTTP 504); request {request_id}")
        return UpstreamFailure(f"The replica answered HTTP 502; request {request_id}", code="bad_gateway")
    if isinstance(error, ConnectFailed):
        return NoUpstream(f"No replica of preset '{preset}' could be reached", headers={"retry-after": "5"})
    if isinstance(error, HeaderTimeout):
        return GatewayTimeout(f"The replica sent no response headers in time; request {request_id}")
    return UpstreamFailure(
        f"The replica closed the connection without an answer; request {request_id}",
        code=f"upstream_{error.kind}",
    )
