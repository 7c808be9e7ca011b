"""Running the gateway under uvicorn: uvloop and httptools, no access log of uvicorn's own."""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
from typing import Any

import uvicorn

from gateway.app import Gateway, metrics_app
from gateway.edge.connection import EdgeLimits, edge_protocol

log = logging.getLogger("gateway")


# How the gateway runs under uvicorn; the tests run it the same way.
SERVER_OPTIONS: dict[str, Any] = {
    "http": "httptools",
    "lifespan": "on",
    "access_log": False,  # the gateway writes its own structured access log
    "server_header": False,  # nothing about the stack behind it
    "proxy_headers": False,  # X-Forwarded-For from clients is never trusted; the gateway sets its own
}


def server_options(gateway: Gateway, nofile: int | None = None) -> dict[str, Any]:
    """SERVER_OPTIONS with the protocol that bounds request heads and connections for this gateway;
    the connection cap is lowered to what the open-file limit (`nofile`, else the process's own)
    can hold."""
    s = gateway.settings
    cap = connection_cap(s.max_connections, file_limit() if nofile is None else nofile)
    limits = EdgeLimits(s.header_timeout, s.max_header_bytes, s.max_header_count, cap)
    return {**SERVER_OPTIONS, "http": edge_protocol(limits, gateway.record)}


def descriptors_wanted(max_connections: int) -> int:
    """Descriptors for the client sockets, one upstream socket each, and some to spare."""
    return 2 * max_connections + 256


def connection_cap(wanted: int, nofile: int) -> int:
    """The most client connections `nofile` descriptors hold: each may need an upstream socket too,
    and a share is kept for the rest (listeners, the access and replica log files, probes, Redis,
    launched engines' pipes). Past the cap a connection gets its 503 at once; past the descriptors
    it would not be accepted at all, and a real request would wait in the backlog unanswered
    (measured: 300 unfinished heads under a hard limit of 256 kept one waiting 10 s)."""
    spare = min(256, nofile // 4)
    return max(1, min(wanted, (nofile - spare) // 2))


def file_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


def raise_file_limit(wanted: int) -> int:
    """Every connection is a descriptor: a soft limit of 256 or 1024 (common defaults) would refuse
    sockets long before `max_connections` does, so lift the soft limit toward the hard one.
    Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # pragma: no cover - a sandbox that forbids it keeps its limit
            log.warning("could not raise the open-file limit from %d", soft)
    return file_limit()


def uvicorn_config(app: Any, host: str, port: int, **overrides: Any) -> uvicorn.Config:
    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "loop": "uvloop",
        "log_config": None,
        "backlog": 2048,
        **SERVER_OPTIONS,
    }
    options.update(overrides)
    return uvicorn.Config(app, **options)


def tune_gc() -> None:
    """Everything alive at start-up (modules, the table, the registry) lives as long as the process:
    frozen, the collector stops re-scanning it, and a younger generation that fills less often
    collects less. Measured on the request path: about a quarter of its CPU time."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def run_loop(main: Any) -> None:
    """Run the gateway's top coroutine on uvloop where it exists."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop has no Windows build
        asyncio.run(main)
    else:
        uvloop.run(main)


async def run(gateway: Gateway, app: Any, banner: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then let running answers finish for `drain_seconds`.

    The demo serves through here too, so it drains the same way.
    """
    settings = gateway.settings
    if not gateway.team.keyring and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "no GATEWAY_API_KEYS set and listening on %s: anyone who can reach it can use the fleet",
            settings.host,
        )
    nofile = raise_file_limit(descriptors_wanted(settings.max_connections))
    cap = connection_cap(settings.max_connections, nofile)
    if cap < settings.max_connections:
        log.warning(
            "the open-file limit is %d: at most %d client connections (GATEWAY_MAX_CONNECTIONS=%d "
            "needs %d descriptors; raise the hard limit, e.g. `ulimit -Hn`, or lower it)",
            nofile,
            cap,
            settings.max_connections,
            descriptors_wanted(settings.max_connections),
        )
    config = uvicorn_config(
        app,
        settings.host,
        settings.port,
        timeout_graceful_shutdown=settings.drain_seconds,
        **server_options(gateway, nofile),
    )
    servers = [uvicorn.Server(config)]
    if settings.metrics_port:
        servers.append(
            uvicorn.Server(uvicorn_config(metrics_app(gateway), settings.host, settings.metrics_port))
        )
    tune_gc()
    if banner:
        print(banner, flush=True)
    log.warning(
        "fleet-gateway listening on http://%s:%d (routes: %s)", settings.host, settings.port, settings.routes
    )
    await asyncio.gather(*(server.serve() for server in servers))
