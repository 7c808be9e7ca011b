"""The composition root: builds the gateway's parts once and wires them to the HTTP surface."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.edge.auth import KeyAuth
from gateway.edge.browser import BrowserGuard, allowed_hosts, allowed_origins
from gateway.edge.door import Door
from gateway.edge.paths import Paths
from gateway.edge.reject import reject
from gateway.errors import GatewayError, MethodNotAllowed, NotFound
from gateway.fleet.discovery import Discovery, Resolver, resolve
from gateway.fleet.prober import Prober
from gateway.fleet.replicas import Fleet
from gateway.fleet.supervisor import Supervisor
from gateway.mcp import call as mcp_call
from gateway.mcp.gate import McpLimits
from gateway.mcp.server import PATH as MCP_PATH
from gateway.mcp.server import McpEndpoint
from gateway.ops import http
from gateway.ops.accesslog import AccessLog
from gateway.ops.exchange import Exchange
from gateway.ops.metrics import Metrics
from gateway.ops.recent import Recent
from gateway.pipeline.frame import Context
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.stored import StoredAnswers
from gateway.routing.table import Table, TableError, load_table
from gateway.settings import Settings
from gateway.team.keys import (
    Keyring,
    KeysError,
    build_keyring,
    load_keys_file,
    plain_keys,
)
from gateway.team.state import create_counters
from gateway.team.team import Team
from gateway.upstream import UpstreamClient, create_client

log = logging.getLogger("gateway")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Gateway:
    """The running gateway's parts. The fleet is swapped whole on reload; nothing else changes."""

    settings: Settings
    fleet: Fleet
    client: UpstreamClient
    registry: CollectorRegistry
    access_log: AccessLog
    clock: Callable[[], float] = time.monotonic
    metrics: Metrics = field(init=False)
    recent: Recent = field(init=False)
    started: float = field(init=False)
    proxy: Proxy = field(init=False)
    prober: Prober = field(init=False)
    discovery: Discovery = field(init=False)
    supervisor: Supervisor = field(init=False)
    team: Team = field(default_factory=Team.solo)
    resolver: Resolver = resolve

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.registry, lambda: self.fleet)
        self.recent = Recent(self.clock)
        self.started = self.clock()
        # A launched replica that is not running is not probed: the prober asks the supervisor.
        self.prober = Prober(lambda: self.fleet, self.client, self.clock, lambda r: self.supervisor.active(r))
        self.supervisor = Supervisor(
            lambda: self.fleet,
            self.client,
            self.settings.state_dir / "logs",
            self.prober.probe,
            self.clock,
            on_load=self.metrics.record_load,
            on_evict=self.metrics.record_eviction,
        )
        self.supervisor.sync()
        self.metrics.supervisor = self.supervisor
        self.metrics.redis = self.team.counters.condition
        self.metrics.redis_round_trips = lambda: self.team.counters.round_trips
        self.proxy = Proxy(
            Context(
                self.settings,
                lambda: self.fleet,
                self.client,
                self.record,
                clock=self.clock,
                lifecycle=self.supervisor,
                team=self.team,
                describe=self.describe_image,
            )
        )
        self.discovery = Discovery(lambda: self.fleet, self.prober.probe, self.resolver, self.clock)

    async def describe_image(self, image: str, instruction: str) -> str:
        """An image from a tool result, described by the table's vision preset through the
        gateway's own request path (pipeline/tool_images.py)."""
        vision = self.fleet.table.images
        if vision is None:
            raise LookupError("no vision preset (routing.images)")
        content = [{"type": "text", "text": instruction}, {"type": "image_url", "image_url": {"url": image}}]
        body = {"model": vision, "max_tokens": 1024, "messages": [{"role": "user", "content": content}]}
        outcome = await mcp_call.run(
            self.proxy.handle, body, tool="describe_image", client_id="gateway:tool_images"
        )
        if outcome.error or outcome.status != 200:
            raise RuntimeError(outcome.error or f"HTTP {outcome.status}")
        return outcome.text

    def record(self, ex: Exchange) -> None:
        if ex.admitted:
            self.team.charge(ex.key, ex.preset, ex.charged(), ex.reservation)
        self.metrics.record(ex)
        self.recent.record(ex)
        self.access_log.write(ex)

    def speeds(self) -> dict[str, float | None]:
        """Each preset's decode speed over the recent window, as the status page shows it."""
        measured = self.recent.decode_speeds()
        return {name: measured.get(name) for name in self.fleet.pools}

    def not_ready(self) -> list[str]:
        """Presets that cannot serve: none ready, and not one that loads on demand (a preset whose
        replicas are all launched starts one for its first request; a failed one counts)."""
        return [p for p in self.fleet.not_ready() if not self.supervisor.on_demand(self.fleet.pools[p])]

    def reload(self) -> Table:
        """Validate first, keep the old table on error, then swap atomically."""
        table = load_table(self.settings.routes)
        keyring = load_keyring(self.settings, table)
        if bool(keyring) != bool(self.team.keyring):
            # Open mode's browser guard is set up at start: switching it needs a restart.
            raise TableError(
                "keys were " + ("removed" if self.team.keyring else "added") + " by the reload; an open "
                "gateway becomes a keyed one (or back) only by a restart"
            )
        if table.state != self.fleet.table.state:
            log.warning("state (Redis) settings change only with a restart; the running ones stay")
        self.fleet = Fleet(table, self.clock, previous=self.fleet)
        self.team.keyring = keyring
        self.supervisor.sync()  # new launched replicas start stopped; dropped ones are stopped
        log.warning("routing table reloaded from %s", table.source)
        return table


class LifespanState(TypedDict):
    """The lifespan's state: Starlette copies it onto each request, so handlers read the running
    `Gateway` as `request.state.gateway`."""

    gateway: Gateway


def build_gateway(
    settings: Settings,
    table: Table | None = None,
    *,
    client: UpstreamClient | None = None,
    registry: CollectorRegistry | None = None,
    access_log: AccessLog | None = None,
    resolver: Resolver = resolve,
) -> Gateway:
    """Builds the running gateway from settings: the routing table (loaded from `settings.routes`
    unless given), the keyring, the counters (Redis or in process, their condition logged and
    counted), the upstream client; tests pass their own client, registry, log or resolver. Raises
    `TableError` on a bad table or keys file."""
    table = table or load_table(settings.routes)
    hooks: list[Callable[[str], None]] = [_log_redis]
    counters = create_counters(
        table.state.redis, table.state.prefix, on_condition=lambda condition: [h(condition) for h in hooks]
    )
    gateway = Gateway(
        settings=settings,
        fleet=Fleet(table),
        client=client or create_client(settings.http_client),
        registry=registry or CollectorRegistry(),
        access_log=access_log or AccessLog(enabled=settings.log_requests, flush_interval=0.2),
        resolver=resolver,
        team=Team(load_keyring(settings, table), counters),
    )
    hooks.append(gateway.metrics.record_redis)
    return gateway


def load_keyring(settings: Settings, table: Table) -> Keyring:
    """routes.yaml's `keys:`, GATEWAY_KEYS_FILE (the same shape), and the anonymous keys of
    GATEWAY_API_KEYS and GATEWAY_API_KEYS_FILE; read at start-up and on SIGHUP."""
    specs = list(table.keys)
    try:
        if settings.keys_file is not None:
            specs += load_keys_file(settings.keys_file)
        anonymous = plain_keys(settings.api_keys)
        if settings.api_keys_file is not None:
            anonymous += plain_keys(settings.api_keys_file.read_text(encoding="utf-8"))
        return build_keyring(specs, anonymous, presets=table.presets)
    except OSError as exc:
        raise TableError(f"cannot read a keys file ({exc.strerror})") from None
    except KeysError as exc:
        raise TableError(str(exc)) from None


def _log_redis(condition: str) -> None:
    if condition == "unreachable":
        log.error("Redis is unreachable: limits and usage are counted in this process until it returns")
    elif condition == "ok":
        log.warning("Redis is reachable: limits and usage are shared again")


def create_app(gateway: Gateway) -> Any:
    """The ASGI app for a built gateway: the proxy, stored answers, /mcp and Starlette's own routes,
    dispatched by path behind key auth, the browser guard, the header door and (when origins are
    set) CORS; its lifespan probes and starts the fleet before serving, handles SIGHUP reloads and
    stops the supervisor, team and client on exit."""
    settings = gateway.settings
    mcp = McpEndpoint(
        gateway.proxy.handle,
        lambda: gateway.fleet,
        gateway.speeds,
        McpLimits.of(settings),
        gateway.record,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[LifespanState]:
        # Discovery and the first probe round run before serving, so early requests see real state.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(gateway.fleet.table.health.timeout + 5):
                if gateway.discovery.wanted():
                    await gateway.discovery.refresh(force=True)
                await gateway.prober.probe_all()
        await gateway.team.start()  # /ready says whether Redis answers from the first request on
        await gateway.supervisor.start(gateway.fleet.table.preload)
        await _wait_ready(gateway)
        probing = asyncio.create_task(gateway.prober.run())
        discovering = asyncio.create_task(gateway.discovery.run()) if gateway.discovery.wanted() else None
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            # Only in the main thread of a real process; tests run servers in threads.
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _reload, gateway)
        try:
            async with mcp.running():
                yield {"gateway": gateway}
        finally:
            for task in (probing, discovering):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await gateway.supervisor.close()  # after the drain: what it started, it stops
            await gateway.team.close()  # after the drain: the last answers' usage is counted
            await gateway.client.aclose()
            gateway.access_log.flush()

    routes = http.routes(metrics=gateway.settings.metrics_port == 0)
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, GatewayError: _http_error},
    )
    # A 307 to the client's own Host header is a redirect the client controls: never.
    app.router.redirect_slashes = False
    record, clock = gateway.record, gateway.clock
    dispatch = Paths(
        gateway.proxy.handle, StoredAnswers(gateway.proxy).handle, app, record, clock, mounts={MCP_PATH: mcp}
    )
    auth = KeyAuth(
        dispatch, lambda: gateway.team.keyring, record, clock, anonymous_admin=settings.anonymous_admin
    )
    guard = BrowserGuard(
        auth,
        open_mode=not gateway.team.keyring,
        loopback=settings.host in LOOPBACK,
        hosts=allowed_hosts(settings.allowed_hosts),
        record=record,
        clock=clock,
        origins=allowed_origins(settings.cors_origins),
    )
    edge: Any = Door(
        dispatch, guard, auth, settings.max_header_bytes, settings.max_header_count, record, clock
    )
    origins = [o.strip() for o in settings.cors_origins.split(",") if o.strip()]
    if origins:
        # Outermost: a preflight carries no key and must be answered before auth.
        edge = CORSMiddleware(
            edge,
            allow_origins=origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "x-gateway-preset", "x-gateway-replica", "x-gateway-rewrites"],
            max_age=600,
        )
    return edge


def metrics_app(gateway: Gateway) -> Any:
    """/metrics alone, for `GATEWAY_METRICS_PORT`: scrapers need no key on a private port."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[LifespanState]:
        yield {"gateway": gateway}

    return Starlette(
        routes=[Route("/metrics", http.all_metrics, methods=["GET"])],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )


class _Reply(Response):
    """A reply already sent through the ASGI `send` (recorded, in the client's dialect)."""

    def __init__(self, error: GatewayError, request: Request) -> None:
        super().__init__()
        self.error, self.request = error, request

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gateway: Gateway = self.request.state.gateway
        await reject(scope, send, self.error, gateway.record, gateway.clock())


async def _http_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, GatewayError):
        return _Reply(exc, request)
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        error: GatewayError = MethodNotAllowed(f"Method {request.method} is not allowed here")
    else:
        error = NotFound(
            "Not found: this path is not an endpoint of the gateway. It serves /v1/chat/completions, "
            "/v1/completions, /v1/messages, /v1/responses, /v1/embeddings and /v1/models (see its docs)"
        )
    return _Reply(error, request)


async def _wait_ready(gateway: Gateway) -> None:
    """`serve --wait`: hold start-up (uvicorn accepts nothing yet) until every preset has a ready
    replica, or the wait is over; then serve anyway, saying which presets are not ready."""
    limit = gateway.settings.wait_ready
    if limit <= 0:
        return
    deadline = gateway.clock() + limit
    while gateway.not_ready() and gateway.clock() < deadline:
        await asyncio.sleep(min(1.0, gateway.fleet.table.health.interval))
        await gateway.prober.probe_all()
    missing = gateway.not_ready()
    if missing:
        log.warning("serving after --wait %gs with presets not ready: %s", limit, ", ".join(missing))
    else:
        log.info("every preset has a ready replica")


def _reload(gateway: Gateway) -> None:
    try:
        gateway.reload()
    except TableError as exc:
        log.error("reload refused, the old routing table stays: %s", exc)
