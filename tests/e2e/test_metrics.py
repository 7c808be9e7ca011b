"""gateway/ops/metrics.py: one Exchange recorded into a fresh CollectorRegistry, read back through
the Prometheus text format exactly as a scraper would see it."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx2
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import metrics_app
from gateway.fleet.replicas import Fleet
from gateway.ops.exchange import Exchange
from gateway.ops.metrics import KEY_FAMILIES, Metrics
from gateway.routing.table import parse_table
from gateway.team.keys import Identity
from tests.support.harness import eventually, one_replica_table, run_gateway
from tests.support.servers import serve, sim_replica

TABLE = """
presets:
  m:
    served_model: m
    replicas:
      - {name: r0, url: "http://127.0.0.1:9301", engine: vllm}
      - {name: r1, url: "http://127.0.0.1:9302", engine: llamacpp}
routing: {default: m}
"""
STATUS_CLASSES = {"1xx", "2xx", "3xx", "4xx", "5xx", "499", "none"}


def build() -> tuple[Metrics, CollectorRegistry, Fleet]:
    fleet = Fleet(parse_table(TABLE), clock=lambda: 0.0)
    registry = CollectorRegistry()
    return Metrics(registry, lambda: fleet), registry, fleet


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of `name` in the exposition, keyed by its sorted labels."""
    text = generate_latest(registry).decode()
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def labels(**values: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(values.items()))


def served(**fields: Any) -> Exchange:
    defaults: dict[str, Any] = {
        "request_id": "req",
        "endpoint": "chat",
        "started": 10.0,
        "preset": "m",
        "route": "model",
        "replica": "r0",
        "engine": "vllm",
        "status": 200,
        "finished": 12.0,
    }
    return Exchange(**{**defaults, **fields})


def test_endpoint_requests_are_counted_by_endpoint_and_status_class() -> None:
    metrics, registry, _ = build()
    metrics.record(served())
    metrics.record(served())
    metrics.record(served(endpoint="messages", status=200))
    metrics.record(Exchange(request_id="x", endpoint="messages", started=0.0, status=401, outcome="rejected"))
    assert samples(registry, "gateway_endpoint_requests_total") == {
        labels(endpoint="chat", status="2xx"): 2.0,
        labels(endpoint="messages", status="2xx"): 1.0,
        labels(endpoint="messages", status="4xx"): 1.0,
    }
    assert "gateway_endpoint_requests_created" not in generate_latest(registry).decode()


def test_status_label_values_are_classes_not_codes() -> None:
    metrics, registry, _ = build()
    for status in (400, 401, 404, 413, 429, 431):
        metrics.record(
            Exchange(request_id="x", endpoint="other", started=0.0, status=status, outcome="rejected")
        )
    metrics.record(Exchange(request_id="x", endpoint="other", started=0.0))  # never answered
    metrics.record(served(status=0, outcome="client_disconnected"))  # left before any header
    metrics.record(served(status=200, outcome="client_disconnected"))  # left mid-stream, after its 200
    endpoint = samples(registry, "gateway_endpoint_requests_total")
    assert endpoint == {
        labels(endpoint="other", status="4xx"): 6.0,
        labels(endpoint="other", status="none"): 1.0,
        labels(endpoint="chat", status="499"): 1.0,
        labels(endpoint="chat", status="2xx"): 1.0,
    }
    statuses = {dict(key)["status"] for key in samples(registry, "gateway_requests_total")}
    assert statuses <= STATUS_CLASSES


def test_a_request_that_reached_no_replica_is_labelled_none_and_unknown() -> None:
    metrics, registry, _ = build()
    metrics.record(Exchange(request_id="x", endpoint="chat", started=0.0, status=404, outcome="rejected"))
    assert samples(registry, "gateway_requests_total") == {
        labels(preset="unknown", replica="none", engine="none", status="4xx", route="none"): 1.0
    }
    # no replica: no tokens, no time to first token
    assert samples(registry, "gateway_tokens_total") == {}
    assert samples(registry, "gateway_time_to_first_token_seconds_count") == {}


def test_a_served_request_counts_its_tokens_duration_retries_and_errors() -> None:
    metrics, registry, _ = build()
    ex = served(
        replica="r1",
        engine="llamacpp",
        upstream_sent=10.5,
        first_token=11.0,
        retries=["connect_error"],
        upstream_errors=["connect_error"],
        failed_replica="r0",
        pick_reason="round_robin",
    )
    ex.answer.prompt_tokens, ex.answer.completion_tokens, ex.answer.cached_tokens = 100, 21, 64
    metrics.record(ex)
    assert samples(registry, "gateway_requests_total") == {
        labels(preset="m", replica="r1", engine="llamacpp", status="2xx", route="model"): 1.0
    }
    assert samples(registry, "gateway_tokens_total") == {
        labels(preset="m", replica="r1", kind="prompt"): 100.0,
        labels(preset="m", replica="r1", kind="cached"): 64.0,
        labels(preset="m", replica="r1", kind="completion"): 21.0,
    }
    assert samples(registry, "gateway_request_duration_seconds_sum") == {
        labels(preset="m", replica="r1"): 2.0
    }
    assert samples(registry, "gateway_overhead_seconds_sum") == {labels(preset="m"): 0.5}
    assert samples(registry, "gateway_time_to_first_token_seconds_sum") == {
        labels(preset="m", replica="r1"): 1.0
    }
    # 20 tokens after the first in 1 s
    assert samples(registry, "gateway_decode_tokens_per_second_sum") == {
        labels(preset="m", replica="r1"): 20.0
    }
    assert samples(registry, "gateway_upstream_retries_total") == {
        labels(preset="m", reason="connect_error"): 1.0
    }
    assert samples(registry, "gateway_upstream_errors_total") == {
        labels(preset="m", replica="r0", kind="connect_error"): 1.0  # the replica that failed, not r1
    }
    assert samples(registry, "gateway_balancer_picks_total") == {
        labels(preset="m", reason="round_robin"): 1.0
    }


@pytest.mark.parametrize(
    ("phase", "label"), [(None, "waiting"), ("streaming", "streaming"), ("write_stall", "write_stall")]
)
def test_client_disconnects_by_phase(phase: str | None, label: str) -> None:
    metrics, registry, _ = build()
    metrics.record(served(outcome="client_disconnected", disconnect_phase=phase))
    assert samples(registry, "gateway_client_disconnects_total") == {labels(preset="m", phase=label): 1.0}


def test_fleet_state_is_read_at_scrape_time() -> None:
    _, registry, fleet = build()
    pool = fleet.pools["m"]
    r0, r1 = pool.get("r0"), pool.get("r1")
    assert r0 is not None and r1 is not None
    r0.health.on_probe("ok", 0.0)
    r1.health.on_probe("fail", 0.0)
    r0.in_flight, r0.context = 3, 4096
    up = samples(registry, "gateway_replica_up")
    assert up == {
        labels(preset="m", replica="r0", engine="vllm"): 1.0,
        labels(preset="m", replica="r1", engine="llamacpp"): 0.0,
    }
    assert samples(registry, "gateway_in_flight")[labels(preset="m", replica="r0", engine="vllm")] == 3.0
    assert samples(registry, "gateway_replica_context_tokens") == {
        labels(preset="m", replica="r0", engine="vllm"): 4096.0
    }
    assert samples(registry, "gateway_panic_mode") == {labels(preset="m"): 0.0}
    r0.in_flight = 1
    assert samples(registry, "gateway_in_flight")[labels(preset="m", replica="r0", engine="vllm")] == 1.0


def test_each_registry_is_its_own() -> None:
    first, first_registry, _ = build()
    _, second_registry, _ = build()
    first.record(served())
    assert samples(first_registry, "gateway_endpoint_requests_total")
    assert samples(second_registry, "gateway_endpoint_requests_total") == {}


def test_the_view_without_keys_drops_every_per_key_family_and_keeps_the_rest() -> None:
    metrics, registry, _ = build()
    metrics.record(served(identity=Identity("alice"), admitted=True))
    full = generate_latest(registry).decode()
    assert 'gateway_key_requests_total{key="alice"' in full
    public = generate_latest(metrics.without_keys).decode()
    assert "gateway_key_" not in public and "alice" not in public
    assert 'gateway_requests_total{engine="vllm"' in public  # everything else is still there
    assert public.count("# TYPE") == full.count("# TYPE") - len(KEY_FAMILIES)


def test_per_key_series_are_for_admin_keys_and_the_metrics_port_only() -> None:
    def secret(name: str) -> str:
        return f"{name}-metrics-key"

    keys = ", ".join(
        f"{{name: {name}, key_sha256: {hashlib.sha256(secret(name).encode()).hexdigest()}, admin: {name == 'root'}}}"
        for name in ("alice", "root")
    )
    replica = sim_replica("vllm", "m")
    try:
        with run_gateway(one_replica_table(replica.url, extra=f"keys: [{keys}]")) as gw:

            def scrape(who: str) -> str:
                auth = {"authorization": f"Bearer {secret(who)}"}
                answer = httpx2.get(gw.url + "/metrics", headers=auth, timeout=10)
                assert answer.status_code == 200
                return answer.text

            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            for who in ("alice", "root"):
                answer = httpx2.post(
                    gw.url + "/v1/chat/completions",
                    json=chat,
                    headers={"authorization": f"Bearer {secret(who)}"},
                    timeout=10,
                )
                assert answer.status_code == 200
            assert eventually(lambda: 'key="root"' in gw.metrics())
            assert "gateway_key_" not in scrape("alice") and 'key="root"' not in scrape("alice")
            assert "gateway_requests_total" in scrape("alice")
            assert 'gateway_key_requests_total{key="alice"' in scrape("root")
            with serve(metrics_app(gw.gateway)) as port:
                scraped = httpx2.get(port.url + "/metrics", timeout=10).text
            assert 'gateway_key_requests_total{key="alice"' in scraped
    finally:
        replica.stop()
