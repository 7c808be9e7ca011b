"""The status page without a browser: the page is self-contained, /ui/state is keyed, and its numbers
agree with /metrics and the JSON access log for the same requests through the demo fleet."""

from __future__ import annotations

import contextlib
import io
import re
from collections import Counter
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import httpx2
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway import __version__
from gateway.app import build_gateway, create_app
from gateway.ops.accesslog import AccessLog
from gateway.settings import Settings
from gateway.simulator import SimConfig
from gateway.simulator import create_app as sim_app
from gateway.tools import demo
from tests.support.harness import Running, eventually, one_replica_table, run_gateway
from tests.support.servers import ThreadServer, serve

HELLO = [{"role": "user", "content": "hello"}]


@contextlib.contextmanager
def demo_gateway(**settings: Any) -> Iterator[Running]:
    """`fleet-gateway demo`'s routing table and replicas, with the simulators at full speed."""
    sims = {}
    try:
        for seed, replica in enumerate(r for group in demo.REPLICAS.values() for r in group):
            config = SimConfig(
                engine=replica.engine,  # type: ignore[arg-type]
                model=replica.model,
                seed=seed,
                slots=replica.slots,
                time_scale=0,
                thinking_default=replica.thinking,
                reasoning_tokens=120,
            )
            sims[replica.name] = ThreadServer(sim_app(config)).start()
        log = io.BytesIO()
        gateway = build_gateway(
            Settings(**settings),
            demo.demo_table({name: sim.port for name, sim in sims.items()}),
            registry=CollectorRegistry(),
            access_log=AccessLog(stream=log),
        )
        with serve(create_app(gateway), http="httptools") as server:
            yield Running(server, gateway, log)
    finally:
        for sim in sims.values():
            sim.stop()


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.tags: Counter[str] = Counter()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        self.links += [value or "" for name, value in attrs if name in ("src", "href", "action")]


def test_the_page_is_one_self_contained_file() -> None:
    with (
        serve(sim_app(SimConfig(engine="vllm", model="m", time_scale=0))) as sim,
        run_gateway(one_replica_table(sim.url)) as gw,
    ):
        response = httpx2.get(gw.url + "/ui")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    parser = _Links()
    parser.feed(page)
    assert (parser.tags["script"], parser.tags["style"], parser.tags["main"]) == (1, 1, 1)
    assert not [link for link in parser.links if re.match(r"\s*(https?:)?//", link, re.IGNORECASE)]
    for external in ("http://", "https://", "@import", "url("):
        assert external not in page
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\bsrc=", page, re.IGNORECASE)
    # Preset names come from config and warning messages from the gateway: never parsed as HTML.
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in page
    assert len(page.splitlines()) < 450


def test_the_page_is_public_but_its_state_needs_the_key() -> None:
    with (
        serve(sim_app(SimConfig(engine="vllm", model="m", time_scale=0))) as sim,
        run_gateway(one_replica_table(sim.url), api_keys="k1") as gw,
    ):
        assert httpx2.get(gw.url + "/ui").status_code == 200
        assert httpx2.get(gw.url + "/ui/state").status_code == 401
        wrong = httpx2.get(gw.url + "/ui/state", headers={"Authorization": "Bearer k2"})
        assert wrong.status_code == 401
        right = httpx2.get(gw.url + "/ui/state", headers={"Authorization": "Bearer k1"})
    assert right.status_code == 200
    state = right.json()
    assert state["version"] == __version__
    assert [p["name"] for p in state["presets"]] == ["m"]
    assert [r["name"] for r in state["presets"][0]["replicas"]] == ["r0"]


def _samples(metrics_text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == name
    ]


def _percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_a_request_through_the_demo_agrees_in_metrics_log_and_ui() -> None:
    system = {"role": "system", "content": "A long and stable system prompt for the prefix cache. " * 30}
    with demo_gateway() as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(3):
            client.chat.completions.create(model="coder", messages=[system, *HELLO], max_tokens=20)
        for chunk in client.chat.completions.create(model="bulk", messages=HELLO, max_tokens=20, stream=True):
            assert chunk.id
        client.chat.completions.create(model="vl", messages=HELLO, max_tokens=10)
        client.completions.create(model="extract", prompt="Once upon a time", max_tokens=10)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="no-such-model", messages=HELLO)
        # Metrics, the window and the log are written in that order just after each last byte.
        assert eventually(lambda: len(gw.log_entries()) == 7)
        state = httpx2.get(gw.url + "/ui/state").json()
        metrics = httpx2.get(gw.url + "/metrics").text
        log = gw.log_entries()

    assert state["totals"]["requests"] == len(log) == 7
    assert sum(value for _, value in _samples(metrics, "gateway_requests_total")) == 7
    assert state["unrouted"] == sum(1 for e in log if e["preset"] == "unknown") == 1

    by_preset = Counter(e["preset"] for e in log)
    by_replica = Counter(e["replica"] for e in log if e["replica"])
    metric_presets: Counter[str] = Counter()
    metric_replicas: Counter[str] = Counter()
    for labels, value in _samples(metrics, "gateway_requests_total"):
        metric_presets[labels["preset"]] += int(value)
        if labels["replica"] != "none":
            metric_replicas[labels["replica"]] += int(value)
    assert by_preset == metric_presets
    assert by_replica == metric_replicas
    assert (by_preset["dense"], by_preset["moe"]) == (3, 1)

    tokens: dict[str, Counter[str]] = {"prompt": Counter(), "cached": Counter()}
    for labels, value in _samples(metrics, "gateway_tokens_total"):
        if labels["kind"] in tokens:
            tokens[labels["kind"]][labels["replica"]] += int(value)
    logged: dict[str, Counter[str]] = {"prompt": Counter(), "cached": Counter()}
    for e in log:
        if e["replica"]:
            logged["prompt"][e["replica"]] += e["prompt_tokens"] or 0
            logged["cached"][e["replica"]] += e["cached_tokens"] or 0
    for kind in ("prompt", "cached"):
        assert +tokens[kind] == +logged[kind]
        assert sum(logged[kind].values()) > 0

    def cache_ratio(replicas: list[str]) -> float | None:
        prompt = sum(logged["prompt"][r] for r in replicas)
        return round(sum(logged["cached"][r] for r in replicas) / prompt, 4) if prompt else None

    assert state["totals"]["cache_hit_ratio"] == cache_ratio(list(logged["prompt"]))
    failed = sum(1 for e in log if e["status"] >= 500 or e["outcome"] == "upstream_error")
    assert state["totals"]["error_ratio"] == round(failed / len(log), 4)
    for preset in state["presets"]:
        assert preset["requests"] == by_preset[preset["name"]]
        names = [r["name"] for r in preset["replicas"]]
        assert preset["cache_hit_ratio"] == cache_ratio(names)
        for replica in preset["replicas"]:
            assert replica["requests"] == by_replica[replica["name"]]
            assert replica["cache_hit_ratio"] == cache_ratio([replica["name"]])
            assert replica["state"] == "up"

    # Time to first token: the same requests, the same values, in all three.
    ttfts = [e["ttft_ms"] for e in log if e["ttft_ms"] is not None]
    assert ttfts
    ttft_count = sum(value for _, value in _samples(metrics, "gateway_time_to_first_token_seconds_count"))
    assert ttft_count == len(ttfts)
    assert state["totals"]["ttft_p50_ms"] == pytest.approx(_percentile_ms(ttfts, 0.5), abs=0.06)
    assert state["totals"]["ttft_p95_ms"] == pytest.approx(_percentile_ms(ttfts, 0.95), abs=0.06)
