"""Several gateway processes, one fleet, state shared through a real redis-server.

Two real `fleet-gateway serve` processes on 127.0.0.1 with `state: {redis: ...}` in front of the same
scripted replicas; the tests start redis-server themselves (Debian's package, no persistence) and stop
and start it to show that the gateways keep serving, say so, and add what they counted meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import hashlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.faults import FaultServer, fault_server
from tests.support.gateway_answers import metric
from tests.support.gateway_process import GatewayProcess, chat_body, wait_until
from tests.support.rawhttp import RawResponse, free_port, http_request
from tests.support.redis import RedisServer, redis_server

pytestmark = pytest.mark.slow
PREFIX = "fg-test:"


def key(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "key_sha256": hashlib.sha256(f"{name}-key".encode()).hexdigest(), **fields}


def routes(replicas: list[FaultServer], redis_url: str, keys: list[dict[str, Any]], policy: str) -> str:
    members = [{"name": f"r{i}", "url": r.url, "engine": "vllm"} for i, r in enumerate(replicas)]
    preset = {
        "served_model": "m",
        "policy": policy,
        "min_max_tokens": 0,
        "retries": {"attempts": 2},
        "limits": {"max_in_flight": 16, "queue": 16, "queue_timeout": 5},
        "replicas": members,
    }
    table = {
        "health": {"interval": 60, "timeout": 1},
        "presets": {"m": preset},
        "routing": {"default": "m"},
        "keys": keys,
        "state": {"redis": redis_url, "prefix": PREFIX},
    }
    return json.dumps(table)


def send(gateway: GatewayProcess, who: str = "alice", content: str = "hello") -> RawResponse:
    headers = [("authorization", f"Bearer {who}-key")]
    body = chat_body(content=content)
    return http_request(gateway.address, "POST", "/v1/chat/completions", body, headers, timeout=20)


def get(gateway: GatewayProcess, target: str, who: str = "alice") -> RawResponse:
    return http_request(gateway.address, "GET", target, headers=[("authorization", f"Bearer {who}-key")])


@contextlib.contextmanager
def gateways(tmp_path: Path, text: str, count: int = 2) -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    try:
        for index in range(count):
            path = tmp_path / f"routes-{index}.yaml"
            path.write_text(text)
            started.append(GatewayProcess(path, free_port()).start())
        yield started
    finally:
        for gateway in started:
            gateway.stop()


def test_two_gateways_share_a_rate_limit_exactly_and_the_round_robin(tmp_path: Path) -> None:
    allowed = 6
    keys = [key("alice", limits={"requests_per_minute": allowed}), key("root", admin=True)]
    with (
        redis_server(tmp_path) as redis,
        fault_server(name="A") as a,
        fault_server(name="B") as b,
        gateways(tmp_path, routes([a, b], redis.url, keys, "round_robin")) as (one, two),
    ):
        answers = [send(gateway) for _ in range(allowed // 2) for gateway in (one, two)]
        assert [r.status for r in answers] == [200] * allowed
        # One ticket for both processes: alternating gateways still alternate replicas.
        assert [r.header("x-gateway-replica") for r in answers] == ["r0", "r1"] * (allowed // 2)
        for gateway in (one, two):
            refused = send(gateway)
            assert refused.status == 429, refused.body
            assert refused.json()["error"]["code"] == "requests_per_minute"
            assert f"requests_per_minute={allowed}" in refused.json()["error"]["message"]
            assert 1 <= int(refused.header("retry-after") or "0") <= 60
        # Usage counted by both is read from either.
        wait_until(lambda: _requests(get(two, "/v1/usage")) == allowed, timeout=5)
        assert _requests(get(two, "/v1/usage")) == allowed
        everyone = get(one, "/v1/usage", who="root").json()["keys"]
        assert everyone["alice"]["m"]["requests"] == allowed
        assert get(one, "/ready").json() == {"status": "ready", "redis": "ok"}
        every_key = redis.client().keys(PREFIX + "*")
        assert every_key and all(redis.client().ttl(name) > 0 for name in every_key)


def test_prefix_affinity_picks_the_same_replica_from_every_gateway(tmp_path: Path) -> None:
    with (
        redis_server(tmp_path) as redis,
        fault_server(name="A") as a,
        fault_server(name="B") as b,
        gateways(tmp_path, routes([a, b], redis.url, [key("alice")], "prefix_affinity")) as (one, two),
    ):
        for conversation in ("alpha", "beta", "gamma", "delta"):
            content = f"{conversation}: " + "a long stable system prompt. " * 40
            picked = {send(g, content=content).header("x-gateway-replica") for g in (one, two, one)}
            assert len(picked) == 1, (conversation, picked)


def _requests(response: RawResponse) -> int:
    presets = response.json().get("presets", {})
    return int(presets.get("m", {}).get("requests", 0))


def test_a_redis_restart_fails_no_request_and_its_usage_is_added_when_it_returns(tmp_path: Path) -> None:
    keys = [key("alice", limits={"requests_per_minute": 10_000})]
    with (
        redis_server(tmp_path) as redis,
        fault_server(name="A") as a,
        gateways(tmp_path, routes([a], redis.url, keys, "round_robin")) as (one, two),
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        before = [send(g) for g in (one, two)]
        assert [r.status for r in before] == [200, 200]
        redis.stop()
        during = [r for g in (one, two) for r in [send(g), send(g)]]  # the first finds it gone
        assert [r.status for r in during] == [200] * 4
        for gateway in (one, two):
            assert get(gateway, "/ready").json() == {"status": "ready", "redis": "unreachable"}
            assert "Redis is unreachable" in gateway.output()
            assert metric(get(gateway, "/metrics").body.decode(), "gateway_redis_up") == 0
        # Requests keep coming, from two clients at once, while redis-server comes back on its port.
        stop_at = 40
        load = [pool.submit(_steady, g, stop_at) for g in (one, two)]
        _restart(redis)
        statuses = [s for future in load for s in future.result(timeout=60)]
        assert statuses == [200] * (2 * stop_at)
        for gateway in (one, two):
            assert wait_until(lambda g=gateway: get(g, "/ready").json().get("redis") == "ok", 10)
            assert "Redis is reachable" in gateway.output()
        sent_since_restart = len(during) + 2 * stop_at
        # The restarted Redis is empty; it now holds every request both counted since it left.
        day = dt.datetime.now(dt.UTC).date().isoformat()
        assert wait_until(lambda: _stored(redis, day) == sent_since_restart, 10), _stored(redis, day)
        assert _requests(get(one, "/v1/usage")) == sent_since_restart


def _steady(gateway: GatewayProcess, count: int) -> list[int]:
    statuses = []
    for _ in range(count):
        statuses.append(send(gateway).status)
    return statuses


def _restart(redis: RedisServer) -> None:
    # Down a moment more, so that requests land both before and after it is back.
    time.sleep(0.3)
    redis.start()


def _stored(redis: RedisServer, day: str) -> int:
    fields = redis.client().hgetall(f"{PREFIX}usage:{day}")
    return sum(int(v) for k, v in fields.items() if k.endswith("\x1frequests") and k.startswith("alice\x1f"))


def test_sighup_reloads_the_keys_of_a_running_gateway(tmp_path: Path) -> None:
    with (
        redis_server(tmp_path) as redis,
        fault_server(name="A") as a,
        gateways(tmp_path, routes([a], redis.url, [key("alice")], "round_robin"), count=1) as (one,),
    ):
        assert send(one, "alice").status == 200 and send(one, "bob").status == 401
        one.routes.write_text(routes([a], redis.url, [key("bob")], "round_robin"))
        one.signal(signal.SIGHUP)
        assert wait_until(lambda: send(one, "bob").status == 200, timeout=10)
        assert send(one, "alice").status == 401
