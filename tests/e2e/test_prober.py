"""gateway/fleet/prober.py: reading `/v1/models` in both engines' shapes, the replicas' own metrics,
and one probe round over real sockets against tiny Starlette replicas on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from gateway.fleet.health import Status
from gateway.fleet.prober import Prober, parse_backend_metrics, parse_models
from gateway.fleet.replicas import Fleet, Replica
from gateway.routing.table import parse_table
from gateway.upstream import create_client
from tests.support.servers import ThreadServer, free_port, serve

VLLM_MODELS = {
    "object": "list",
    "data": [
        {
            "id": "qwen-coder",
            "object": "model",
            "owned_by": "vllm",
            "root": "/models/qwen",
            "parent": None,
            "max_model_len": 32768,
        }
    ],
}
LLAMA_MODELS = {
    "models": [{"name": "tiny.gguf", "model": "tiny.gguf"}],
    "object": "list",
    "data": [
        {
            "id": "tiny.gguf",
            "object": "model",
            "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_ctx_train": 131072, "n_ctx": 8192, "n_params": 123},
        }
    ],
}


@pytest.mark.parametrize(
    ("payload", "ids", "context"),
    [
        (VLLM_MODELS, ("qwen-coder",), 32768),
        (LLAMA_MODELS, ("tiny.gguf",), 8192),  # n_ctx, the slot's context, not n_ctx_train
        (
            {"data": [{"id": "a", "max_model_len": 4096}, {"id": "b", "max_model_len": 8192}]},
            ("a", "b"),
            4096,
        ),
        ({"data": [{"id": "a"}, {"id": "b", "max_model_len": 2048}]}, ("a", "b"), 2048),
        ({"data": [{"id": "a", "max_model_len": 0}]}, ("a",), None),
        ({"data": [{"id": "a", "max_model_len": -1, "meta": {"n_ctx": "big"}}]}, ("a",), None),
        ({"data": [{"id": 7}, "not-a-card", {"id": "ok"}]}, ("ok",), None),
        ({"data": {"id": "a"}}, (), None),
        ({"object": "list"}, (), None),
        ([], (), None),
        (None, (), None),
    ],
)
def test_parse_models(payload: Any, ids: tuple[str, ...], context: int | None) -> None:
    assert parse_models(payload) == (ids, context)


def test_parse_backend_metrics_combines_label_sets() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_waiting Requests waiting.",
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{model_name="a"} 2.0',
            'vllm:num_requests_waiting{model_name="b"} 3.0',
            'vllm:kv_cache_usage_perc{engine="0"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1"} 0.5',
            "vllm:prefix_cache_hits_total 10",
            "vllm:some_other_metric 99",
            "vllm:num_requests_running not-a-number",
            "",
        ]
    )
    assert parse_backend_metrics(text) == {
        "requests_waiting": 5.0,  # counts add up
        "kv_cache_usage_ratio": 0.5,  # a ratio is the highest
        "prefix_cache_hits_tokens": 10.0,
    }


# --- a probe round ----------------------------------------------------------------------------


@dataclass
class StubReplica:
    """A tiny replica: what it answers on each probe path, and the headers it was sent."""

    health: int = 200
    models: Any = field(default_factory=lambda: VLLM_MODELS)
    props: Any = None
    metrics: str | None = None
    seen: list[tuple[str, str | None]] = field(default_factory=list)

    def app(self) -> Starlette:
        def record(request: Request) -> None:
            self.seen.append((request.url.path, request.headers.get("authorization")))

        async def health(request: Request) -> Response:
            record(request)
            if self.health == 200:
                return JSONResponse({"status": "ok"})
            return JSONResponse({"error": {"code": 503, "message": "Loading model"}}, status_code=self.health)

        async def models(request: Request) -> Response:
            record(request)
            return JSONResponse(self.models)

        async def props(request: Request) -> Response:
            record(request)
            return JSONResponse(self.props) if self.props is not None else Response(status_code=404)

        async def metrics(request: Request) -> Response:
            record(request)
            if self.metrics is None:
                return PlainTextResponse("metrics disabled", status_code=501)
            return PlainTextResponse(self.metrics)

        return Starlette(
            routes=[
                Route("/health", health),
                Route("/v1/models", models),
                Route("/props", props),
                Route("/metrics", metrics),
            ]
        )


@pytest.fixture
def replicas() -> Iterator[dict[str, tuple[StubReplica, ThreadServer]]]:
    plan = {
        "v0": StubReplica(metrics='vllm:num_requests_running{model_name="qwen-coder"} 3\n'),
        "l0": StubReplica(models=LLAMA_MODELS, props={"total_slots": 4}),
        "loading": StubReplica(health=503, models=LLAMA_MODELS, props={"total_slots": 4}),
    }
    servers = {name: (stub, ThreadServer(stub.app()).start()) for name, stub in plan.items()}
    yield servers
    for _, server in servers.values():
        server.stop()


def fleet_of(servers: dict[str, tuple[StubReplica, ThreadServer]], gone: str) -> Fleet:
    text = f"""
presets:
  m:
    served_model: m
    replicas:
      - {{name: v0, url: "{servers["v0"][1].url}", engine: vllm, api_key_env: PROBE_TEST_KEY}}
      - {{name: l0, url: "{servers["l0"][1].url}", engine: llamacpp}}
      - {{name: loading, url: "{servers["loading"][1].url}", engine: llamacpp}}
      - {{name: gone, url: "{gone}", engine: vllm}}
routing: {{default: m}}
"""
    return Fleet(parse_table(text))


def get(fleet: Fleet, name: str) -> Replica:
    replica = fleet.pools["m"].get(name)
    assert replica is not None
    return replica


@pytest.mark.anyio
async def test_a_probe_round_reads_health_models_props_and_metrics(
    replicas: dict[str, tuple[StubReplica, ThreadServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROBE_TEST_KEY", "probe-secret")
    fleet = fleet_of(replicas, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    client = create_client("lean")
    try:
        prober = Prober(lambda: fleet, client)
        await prober.probe_all()
    finally:
        await client.aclose()
    assert prober.cycles == 1

    v0 = get(fleet, "v0")
    assert v0.health.status is Status.UP
    assert (v0.served_ids, v0.context, v0.slots) == (("qwen-coder",), 32768, None)
    assert v0.backend_metrics == {"requests_running": 3.0}
    assert v0.probe_latency is not None
    stub_v0 = replicas["v0"][0]
    assert {path for path, _ in stub_v0.seen} == {
        "/health",
        "/v1/models",
        "/metrics",
    }  # /props: llama.cpp only
    assert {auth for _, auth in stub_v0.seen} == {"Bearer probe-secret"}

    l0 = get(fleet, "l0")
    assert l0.health.status is Status.UP
    assert (l0.served_ids, l0.context, l0.slots) == (("tiny.gguf",), 8192, 4)
    assert l0.backend_metrics == {}  # llama-server without --metrics answers 501
    assert {auth for _, auth in replicas["l0"][0].seen} == {None}

    # llama-server while loading: /health 503, though /v1/models would answer. Down, and not read.
    loading = get(fleet, "loading")
    assert loading.health.status is Status.DOWN
    assert (loading.served_ids, loading.context, loading.slots) == ((), None, None)
    assert [path for path, _ in replicas["loading"][0].seen] == ["/health"]

    gone = get(fleet, "gone")
    assert gone.health.status is Status.DOWN and gone.context is None


@pytest.mark.anyio
async def test_a_replica_that_recovers_comes_back_and_keeps_what_it_reported() -> None:
    stub = StubReplica(health=503)
    with serve(stub.app()) as server:
        fleet = Fleet(
            parse_table(
                f"""
health: {{healthy_threshold: 2}}
presets:
  m:
    served_model: m
    replicas: [{{name: r, url: "{server.url}", engine: vllm}}]
routing: {{default: m}}
"""
            )
        )
        replica = get(fleet, "r")
        client = create_client("lean")
        try:
            prober = Prober(lambda: fleet, client)
            assert await prober.probe(replica) == "fail"
            assert replica.health.status is Status.DOWN and replica.context is None
            stub.health = 200
            assert await prober.probe(replica) == "ok"
            assert replica.health.status is Status.DOWN  # one success is not enough after a failure
            assert replica.context == 32768  # but a healthy answer lets /v1/models be read
            stub.models = {"object": "list", "data": []}
            assert await prober.probe(replica) == "ok"
        finally:
            await client.aclose()
    assert replica.health.status is Status.UP
    assert replica.served_ids == ("qwen-coder",)  # an empty list does not erase what was known
