"""Prefix handling through the gateway: warnings, move, fingerprints, churn and prefix-affinity routing."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import orjson
import pytest

from gateway.simulator import SimConfig, create_app
from tests.support.harness import Running, eventually, run_gateway
from tests.support.servers import ThreadServer


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ThreadServer]]:
    servers = [
        ThreadServer(create_app(SimConfig(engine="vllm", model="m", time_scale=0, seed=i))).start()
        for i in range(3)
    ]
    yield servers
    for server in servers:
        server.stop()


def table(replicas: list[ThreadServer]) -> str:
    listing = ", ".join(
        f'{{name: r{i}, url: "{server.url}", engine: vllm}}' for i, server in enumerate(replicas[:2])
    )
    return f"""
presets:
  warned:
    served_model: m
    prefix: {{volatile: warn}}
    replicas: [{{name: w0, url: "{replicas[2].url}", engine: vllm}}]
  moved:
    served_model: m
    prefix: {{volatile: move}}
    replicas: [{{name: m0, url: "{replicas[2].url}", engine: vllm}}]
  sticky:
    served_model: m
    policy: prefix_affinity
    replicas: [{listing}]
  rr:
    served_model: m
    replicas: [{listing}]
routing: {{default: warned}}
"""


@pytest.fixture(scope="module")
def gw(replicas: list[ThreadServer]) -> Iterator[Running]:
    with run_gateway(table(replicas)) as running:
        yield running


@pytest.fixture
def client(gw: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)


def system(stamp: str) -> list[dict[str, Any]]:
    long = "You are a careful coding agent. Follow the repository's conventions. " * 20
    return [
        {"role": "system", "content": f"{long}\nCurrent time: {stamp}"},
        {"role": "user", "content": "hi"},
    ]


def last_body(server: ThreadServer) -> dict[str, Any]:
    return orjson.loads(httpx2.get(server.url + "/sim/stats").json()["last_bodies"][-1])  # type: ignore[no-any-return]


def test_warn_mode_names_the_volatile_content_and_counts_it(client: openai.OpenAI, gw: Running) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="warned", messages=system("2026-12-02T10:00:00Z")
    )
    assert raw.headers["x-gateway-prefix-warning"] == "volatile content in the system prompt: timestamp"
    assert len(raw.headers["x-gateway-prefix"]) == 12
    assert eventually(
        lambda: 'gateway_prefix_volatile_total{kind="timestamp",preset="warned"}' in gw.metrics()
    )


def test_warn_mode_logs_a_client_with_a_fresh_timestamp_once(
    client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    """Every call of such a client has another fingerprint; the log names the prompt, not each call."""
    with caplog.at_level("WARNING", logger="gateway.pipeline.prefix"):
        for second in range(3):
            client.chat.completions.create(
                model="warned", messages=system(f"2026-12-02T11:00:0{second}Z"), user="once"
            )
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.pipeline.prefix"]
    assert len(lines) == 1, lines
    assert "timestamp" in lines[0] and "cannot hit" in lines[0]
    assert "2026-12-02" not in lines[0] and "careful coding agent" not in lines[0]  # never the text


def test_a_clients_session_name_is_never_logged_as_sent(
    client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    """The body's `user` is the client's text, of any length and content;
    a newline in it forged a log line and an e-mail address was logged as is."""
    user = "alice@example.com\nERROR gateway: forged " + "x" * 100_000
    with caplog.at_level("WARNING", logger="gateway.pipeline.prefix"):
        client.chat.completions.create(model="warned", messages=system("2026-12-02T12:00:00Z"), user=user)
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.pipeline.prefix"]
    assert len(lines) == 1, lines
    assert "alice@example.com" not in lines[0] and "\n" not in lines[0] and "forged" not in lines[0]
    assert len(lines[0]) < 400 and "/s:" in lines[0]  # a short hash names the session


def test_move_mode_keeps_the_prefix_byte_stable_and_the_cache_hitting(
    client: openai.OpenAI, replicas: list[ThreadServer]
) -> None:
    httpx2.post(replicas[2].url + "/sim/reset")
    first = client.chat.completions.with_raw_response.create(
        model="moved", messages=system("2026-12-02T10:00:00Z")
    )
    second = client.chat.completions.with_raw_response.create(
        model="moved", messages=system("2026-12-02T10:00:07Z")
    )
    assert first.headers["x-gateway-prefix"] == second.headers["x-gateway-prefix"]
    assert "prefix=moved:timestamp" in second.headers["x-gateway-rewrites"]
    sent = last_body(replicas[2])
    assert "Current time" not in sent["messages"][0]["content"]
    assert sent["messages"][-1]["content"] == "hi\n\n[Current time: 2026-12-02T10:00:07Z]"
    cached = int(second.headers["x-gateway-cached-tokens"])
    assert cached > 0.8 * second.parse().usage.prompt_tokens  # type: ignore[union-attr]


def test_without_move_the_changing_timestamp_defeats_the_cache(
    client: openai.OpenAI, replicas: list[ThreadServer]
) -> None:
    httpx2.post(replicas[2].url + "/sim/reset")
    messages = [
        {"role": "system", "content": "ts 2026-12-02T10:00:00Z. " + "Stable text. " * 40},
        {"role": "user", "content": "hi"},
    ]
    client.chat.completions.create(model="warned", messages=messages)
    messages[0]["content"] = messages[0]["content"].replace("10:00:00", "10:00:09")
    second = client.chat.completions.with_raw_response.create(model="warned", messages=messages)
    assert int(second.headers["x-gateway-cached-tokens"]) < 0.1 * second.parse().usage.prompt_tokens  # type: ignore[union-attr]


def test_prefix_churn_is_counted_per_client(client: openai.OpenAI, gw: Running) -> None:
    for stamp in ("01", "02", "03"):
        client.chat.completions.create(model="warned", messages=system(f"2026-12-02T10:00:{stamp}Z"))
    assert eventually(lambda: 'gateway_prefix_churn_total{preset="warned"}' in gw.metrics())
    entries = eventually(
        lambda: [e for e in gw.log_entries() if e["preset"] == "warned" and e["prefix_churn"]]
    )
    assert entries[-1]["client_id"] == "ip:127.0.0.1"


def conversation(index: int, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "shared system prompt " * 10},
        {"role": "user", "content": f"task number {index}"},
    ]
    for turn in range(1, turns):
        messages += [
            {"role": "assistant", "content": f"answer {turn}"},
            {"role": "user", "content": f"more {turn}"},
        ]
    return messages


def test_prefix_affinity_keeps_each_conversation_on_one_replica(client: openai.OpenAI) -> None:
    homes: dict[int, set[str]] = defaultdict(set)
    for turns in range(1, 5):
        for index in range(8):
            raw = client.chat.completions.with_raw_response.create(
                model="sticky", messages=conversation(index, turns)
            )
            homes[index].add(raw.headers["x-gateway-replica"])
    assert all(len(replicas) == 1 for replicas in homes.values())
    assert {next(iter(r)) for r in homes.values()} == {"r0", "r1"}  # conversations spread over both


def test_round_robin_spreads_a_conversation(client: openai.OpenAI) -> None:
    seen = {
        client.chat.completions.with_raw_response.create(model="rr", messages=conversation(1, turns)).headers[
            "x-gateway-replica"
        ]
        for turns in range(1, 5)
    }
    assert seen == {"r0", "r1"}


def test_a_session_header_wins_over_the_conversation(client: openai.OpenAI) -> None:
    seen = {
        client.chat.completions.with_raw_response.create(
            model="sticky", messages=conversation(index, 1), extra_headers={"x-session-id": "agent-42"}
        ).headers["x-gateway-replica"]
        for index in range(8)
    }
    assert len(seen) == 1
