"""Counts kept as plain numbers expose exactly what prometheus_client's own metrics would."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.ops import metrics  # noqa: F401 - as in the gateway: no `_created` series
from gateway.ops.tally import Tallies

BUCKETS = (0.005, 0.1, 1, 2.5, 60)
VALUES = (0.001, 0.005, 0.0051, 0.1, 0.7, 1, 2.5, 59.9, 60, 61, 1e9)


def _theirs() -> bytes:
    registry = CollectorRegistry()
    requests = Counter("gateway_requests", "Requests.", ["preset", "status"], registry=registry)
    seconds = Histogram("gateway_seconds", "Seconds.", ["preset"], buckets=BUCKETS, registry=registry)
    Counter("gateway_unused", "Never counted.", ["kind"], registry=registry)
    requests.labels("a", "2xx").inc()
    requests.labels("a", "2xx").inc(41)
    requests.labels("b", "5xx").inc()
    for value in VALUES:
        seconds.labels("a").observe(value)
    return generate_latest(registry)


def _ours() -> bytes:
    registry = CollectorRegistry()
    tallies = Tallies()
    requests = tallies.counter("gateway_requests", "Requests.", ["preset", "status"])
    seconds = tallies.histogram("gateway_seconds", "Seconds.", ["preset"], BUCKETS)
    tallies.counter("gateway_unused", "Never counted.", ["kind"])
    registry.register(tallies)
    requests.inc(("a", "2xx"))
    requests.inc(("a", "2xx"), 41)
    requests.inc(("b", "5xx"))
    for value in VALUES:
        seconds.observe(("a",), value)
    return generate_latest(registry)


def test_the_exposition_is_the_same_as_prometheus_clients_own_metrics() -> None:
    assert _ours() == _theirs()


def test_a_name_already_registered_is_refused_as_for_any_collector() -> None:
    registry = CollectorRegistry()
    Counter("gateway_requests", "Requests.", registry=registry)
    tallies = Tallies()
    tallies.counter("gateway_requests", "Requests.", [])
    try:
        registry.register(tallies)
    except ValueError:
        return
    raise AssertionError("a duplicate family name was accepted")
