"""The composition root: builds the gateway's parts once and wires them to the HTTP surface."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.edge.auth import KeyAuth
from gateway.edge.browser import BrowserGuard, allowed_hosts, allowed_origins
from gateway.edge.dispatch import Dispatch, MethodNotAllowed
from gateway.edge.guard import HeaderLimits
from gateway.edge.reject import reject
from gateway.errors import BadRequest, Forbidden, GatewayError, NotFound
from gateway.fleet.discovery import Discovery, Resolver, resolve
from gateway.fleet.prober import Prober
from gateway.fleet.replicas import Fleet
from gateway.fleet.stored import Owner
from gateway.fleet.supervisor import Supervisor
from gateway.mcp.gate import McpLimits
from gateway.mcp.server import PATH as MCP_PATH
from gateway.mcp.server import McpEndpoint
from gateway.ops import catalogue, status
from gateway.ops.accesslog import AccessLog
from gateway.ops.exchange import Exchange
from gateway.ops.metrics import Metrics
from gateway.ops.recent import Recent
from gateway.pipeline.proxy import Context, Proxy
from gateway.pipeline.stored import StoredAnswers
from gateway.routing.table import Table, TableError, load_table
from gateway.settings import Settings
from gateway.team.keys import (
    ANONYMOUS,
    OPEN,
    Identity,
    KeyError_,
    Keyring,
    build_keyring,
    load_keys_file,
    plain_keys,
)
from gateway.team.state import create_counters
from gateway.team.team import Team
from gateway.upstream import UpstreamClient, create_client

log = logging.getLogger("gateway")

UI_PAGE = Path(__file__).parent / "ops" / "ui" / "index.html"
NO_STORE = {"cache-control": "no-store"}
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
            )
        )
        self.discovery = Discovery(lambda: self.fleet, self.prober.probe, self.resolver, self.clock)

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


class State(TypedDict):
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
    except KeyError_ as exc:
        raise TableError(str(exc)) from None


def _log_redis(condition: str) -> None:
    if condition == "unreachable":
        log.error("Redis is unreachable: limits and usage are counted in this process until it returns")
    elif condition == "ok":
        log.warning("Redis is reachable: limits and usage are shared again")


def create_app(gateway: Gateway) -> Any:
    settings = gateway.settings
    mcp = McpEndpoint(
        gateway.proxy.handle,
        lambda: gateway.fleet,
        gateway.speeds,
        McpLimits.of(settings),
        gateway.record,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[State]:
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

    routes = [
        # Claude Code probes `HEAD /` before its first request.
        Route("/", _root, methods=["GET", "HEAD"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/v1/models/{model:path}", _model, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/ready", _ready, methods=["GET"]),
        Route("/ui", _ui_page, methods=["GET"]),
        Route("/ui/state", _ui_state, methods=["GET"]),
        Route("/v1/usage", _usage, methods=["GET"]),
        Route("/admin/replicas", _admin_replicas, methods=["GET"]),
        Route("/admin/replicas/{name}/{action}", _admin_action, methods=["POST"]),
    ]
    if gateway.settings.metrics_port == 0:
        routes.append(Route("/metrics", _metrics, methods=["GET"]))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, GatewayError: _http_error},
    )
    # A 307 to the client's own Host header is a redirect the client controls: never.
    app.router.redirect_slashes = False
    record, clock = gateway.record, gateway.clock
    dispatch = Dispatch(
        gateway.proxy.handle, StoredAnswers(gateway.proxy).handle, app, record, clock, mounts={MCP_PATH: mcp}
    )
    authorised = KeyAuth(
        dispatch, lambda: gateway.team.keyring, record, clock, anonymous_admin=settings.anonymous_admin
    )
    guarded = BrowserGuard(
        authorised,
        open_mode=not gateway.team.keyring,
        loopback=settings.host in LOOPBACK,
        hosts=allowed_hosts(settings.allowed_hosts),
        record=record,
        clock=clock,
        origins=allowed_origins(settings.cors_origins),
    )
    edge: Any = HeaderLimits(guarded, settings.max_header_bytes, settings.max_header_count, record, clock)
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
    async def lifespan(app: Starlette) -> AsyncIterator[State]:
        yield {"gateway": gateway}

    return Starlette(
        routes=[Route("/metrics", _all_metrics, methods=["GET"])],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.state.gateway
    return gateway


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


async def _root(request: Request) -> Response:
    if request.method == "HEAD":
        return Response(status_code=200, media_type="application/json")
    return _json({"name": "fleet-gateway", "models": "/v1/models", "status": "/ui", "health": "/health"})


async def _models(request: Request) -> Response:
    """The catalogue in the shape the asking agent reads: Anthropic's for `anthropic-version`
    requests, else OpenAI's (Codex's own shape only with a configured base prompt: catalogue.py)."""
    cards = catalogue.cards(_gateway(request).fleet)
    return _json(catalogue.listing(cards, catalogue.shape(request.query_params, request.headers)))


async def _model(request: Request) -> Response:
    fleet = _gateway(request).fleet
    name = request.path_params["model"]
    card = catalogue.card(fleet, name)
    if card is None:
        raise NotFound(
            f"The model '{name[:64]}' is not served here. Valid: {', '.join(fleet.table.model_names())}",
            code="model_not_found",
        )
    if "anthropic-version" in request.headers:
        return _json(catalogue.anthropic_card(card))
    return _json(card)


async def _health(request: Request) -> Response:
    return _json({"status": "ok"})


async def _ready(request: Request) -> Response:
    gateway = _gateway(request)
    missing = gateway.not_ready()
    # Redis going away does not make the gateway unready: it counts locally meanwhile, and says so.
    extra = {"redis": condition} if (condition := gateway.team.counters.condition()) != "local" else {}
    if missing:
        return _json({"status": "not_ready", "not_ready": missing, **extra}, status=503)
    return _json({"status": "ready", **extra})


async def _usage(request: Request) -> Response:
    """The caller's own usage today (`?days=7`: the last seven days); every key's for an admin."""
    gateway = _gateway(request)
    identity: Identity = request.scope.get("gateway.identity") or OPEN
    days_text = request.query_params.get("days", "1")
    # str.isdigit() also accepts superscripts and other scripts' digits, which int() refuses; and
    # int() refuses more than 4300 digits.
    whole = days_text.isascii() and days_text.isdigit() and len(days_text) <= 3
    if not whole or not 1 <= int(days_text) <= 35:
        raise BadRequest("days must be a whole number from 1 to 35", code="invalid_days", param="days")
    return _json(await gateway.team.usage(identity, int(days_text)))


def _admin_only(request: Request) -> None:
    """With keys, the admin endpoints are for admin keys (edge/auth.py's is_admin decides)."""
    if not Owner.of(request.scope).admin:
        identity: Identity = request.scope.get("gateway.identity") or OPEN
        hint = ""
        if identity.name == ANONYMOUS:
            hint = "; a plain GATEWAY_API_KEYS key is one only with GATEWAY_ANONYMOUS_ADMIN=true"
        raise Forbidden(f"Key '{identity.name}' is not an admin key{hint}", code="admin_only")


async def _admin_replicas(request: Request) -> Response:
    """The launched replicas, for `fleet-gateway ps` (behind the key, like every non-public path)."""
    _admin_only(request)
    return _json({"replicas": _gateway(request).supervisor.view()})


async def _admin_action(request: Request) -> Response:
    _admin_only(request)
    gateway = _gateway(request)
    name, action = request.path_params["name"], request.path_params["action"]
    supervisor = gateway.supervisor
    if name not in supervisor.units:
        raise NotFound(
            f"No launched replica '{name[:64]}'; launched: {', '.join(supervisor.units) or 'none'}"
        )
    if action == "start":
        pool_timeout = max(p.preset.timeouts.load for p in gateway.fleet.pools.values())
        unit = await supervisor.start_one(name, gateway.clock() + pool_timeout)
    elif action == "stop":
        unit = await supervisor.stop_one(name)
    else:
        raise NotFound(f"Unknown action '{action[:32]}': start or stop")
    return _json({"name": unit.name, "state": unit.state, "reason": unit.reason})


async def _ui_page(request: Request) -> Response:
    return Response(UI_PAGE.read_bytes(), media_type="text/html; charset=utf-8", headers=NO_STORE)


async def _ui_state(request: Request) -> Response:
    gateway = _gateway(request)
    payload = status.state(gateway.fleet, gateway.recent, gateway.started, launched=gateway.supervisor.view())
    identity: Identity = request.scope.get("gateway.identity") or OPEN
    payload["team"] = {
        "redis": gateway.team.counters.condition(),
        "today": _by_key(await gateway.team.usage(identity, 1)),
        "week": _by_key(await gateway.team.usage(identity, 7)),
    }
    return Response(orjson.dumps(payload), media_type="application/json", headers=NO_STORE)


def _by_key(usage: dict[str, Any]) -> dict[str, Any]:
    """One shape for the status page, whether the key sees its own usage or every key's."""
    keys = usage["keys"] if "keys" in usage else {usage["key"]: usage["presets"]}
    return {"since": usage["since"], "keys": keys}


async def _metrics(request: Request) -> Response:
    """/metrics on the main port: every series for an admin key (and an open gateway's user); a
    key that is not an admin gets all but the per-key series, as /v1/usage shows it only its own."""
    gateway = _gateway(request)
    registry = gateway.registry if Owner.of(request.scope).admin else gateway.metrics.without_keys
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def _all_metrics(request: Request) -> Response:
    """/metrics on GATEWAY_METRICS_PORT: every series, for the scraper of a private port."""
    return Response(generate_latest(_gateway(request).registry), media_type=CONTENT_TYPE_LATEST)


class _Reply(Response):
    """A reply already sent through the ASGI `send` (recorded, in the client's dialect)."""

    def __init__(self, error: GatewayError, request: Request) -> None:
        super().__init__()
        self.error, self.request = error, request

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gateway = _gateway(self.request)
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
