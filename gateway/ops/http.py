"""The operator's HTTP surface (Starlette routes): the model catalogue, health and readiness, the
status page and its data, a key's usage, the launched replicas' admin endpoints, and the metrics.

The handlers read the running gateway from the lifespan state (`request.state.gateway`, built in
app.py), typed here by what they use of it (`Surface`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.errors import BadRequest, Forbidden, NotFound
from gateway.fleet.replicas import Fleet
from gateway.fleet.stored import Owner
from gateway.fleet.supervisor import Supervisor
from gateway.ops import catalogue, status
from gateway.ops.metrics import Metrics
from gateway.ops.recent import Recent
from gateway.team.keys import ANONYMOUS, OPEN, Identity
from gateway.team.team import Team

UI_PAGE = Path(__file__).parent / "ui" / "index.html"
NO_STORE = {"cache-control": "no-store"}


class Surface(Protocol):
    """What these handlers read of the running gateway."""

    fleet: Fleet
    team: Team
    supervisor: Supervisor
    registry: CollectorRegistry
    metrics: Metrics
    recent: Recent
    started: float

    def clock(self) -> float: ...

    def not_ready(self) -> list[str]: ...


def routes(*, metrics: bool) -> list[Route]:
    """The operator's routes; `/metrics` among them unless it has its own port."""
    found = [
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
    if metrics:
        found.append(Route("/metrics", _metrics, methods=["GET"]))
    return found


def _gateway(request: Request) -> Surface:
    gateway: Surface = request.state.gateway
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


async def all_metrics(request: Request) -> Response:
    """/metrics on GATEWAY_METRICS_PORT: every series, for the scraper of a private port."""
    return Response(generate_latest(_gateway(request).registry), media_type=CONTENT_TYPE_LATEST)
