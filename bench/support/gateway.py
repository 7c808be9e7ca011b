"""The gateway on 127.0.0.1 in a background thread, for tests and benchmarks alike: a routing table
given as YAML text, settings as keywords; the caller talks to it over a real socket, under uvicorn
with httptools as in production."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from bench.support.servers import ThreadServer, serve
from gateway.app import Gateway, build_gateway, create_app
from gateway.ops.accesslog import AccessLog
from gateway.routing.table import parse_table
from gateway.server import server_options
from gateway.settings import Settings


@dataclass
class Running:
    server: ThreadServer
    gateway: Gateway
    log: io.BytesIO

    @property
    def url(self) -> str:
        return self.server.url

    def log_entries(self) -> list[dict[str, Any]]:
        return [orjson.loads(line) for line in self.log.getvalue().splitlines() if line.strip()]

    def metrics(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.gateway.registry).decode()


@contextlib.contextmanager
def run_gateway(table: str, resolver: Any = None, **settings: Any) -> Iterator[Running]:
    log = io.BytesIO()
    gateway = build_gateway(
        Settings(**settings),
        parse_table(table, "test-routes.yaml"),
        registry=CollectorRegistry(),
        access_log=AccessLog(stream=log),
        **({"resolver": resolver} if resolver is not None else {}),
    )
    with serve(create_app(gateway), **server_options(gateway)) as server:
        yield Running(server, gateway, log)
