"""Replicas discovered from DNS, with a stub resolver standing in for a headless Service."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx2
import pytest

from gateway.fleet.discovery import Discovery, discovered_spec, update_pool
from gateway.fleet.replicas import Fleet, Replica
from gateway.routing.table import Discover, parse_table
from gateway.simulator import SimConfig, create_app
from tests.support.harness import eventually, run_gateway
from tests.support.servers import ThreadServer

TABLE = """
presets:
  dense:
    served_model: m
    discover: {dns: vllm-dense.models.svc.cluster.local, port: PORT, engine: vllm, every: 0.2}
routing: {default: dense}
"""


class StubDns:
    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        answer = self.answers[0] if len(self.answers) == 1 else self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_discovered_names_and_urls() -> None:
    found = Discover(dns="x", port=8000, engine="vllm")
    assert discovered_spec("dense", found, "10.0.0.5").url == "http://10.0.0.5:8000"
    v6 = discovered_spec("dense", found, "fd00::5")
    assert v6.url == "http://[fd00::5]:8000" and v6.name == "dense-fd00..5-8000"


def test_update_pool_adds_and_removes_only_discovered_members() -> None:
    table = parse_table(
        """
presets:
  p:
    served_model: m
    replicas: [{name: fixed, url: "http://127.0.0.1:1", engine: vllm}]
    discover: {dns: d, port: 8000, engine: vllm}
routing: {default: p}
"""
    )
    fleet = Fleet(table)
    pool = fleet.pools["p"]
    found = table.presets["p"].discover
    assert found is not None
    added, removed = update_pool(
        pool, [discovered_spec("p", found, a) for a in ("10.0.0.1", "10.0.0.2")], table.health
    )
    assert [r.name for r in added] == ["p-10.0.0.1-8000", "p-10.0.0.2-8000"] and removed == []
    survivor: Replica = pool.replicas[2]
    added, removed = update_pool(pool, [discovered_spec("p", found, "10.0.0.2")], table.health)
    assert added == [] and removed == ["p-10.0.0.1-8000"]
    assert [r.name for r in pool.replicas] == ["fixed", "p-10.0.0.2-8000"]
    assert pool.replicas[1] is survivor  # state kept


def test_a_dns_failure_keeps_the_replicas_it_had() -> None:
    table = parse_table(TABLE.replace("PORT", "8000"))
    fleet = Fleet(table)
    probed: list[str] = []

    async def probe(replica: Replica) -> None:
        probed.append(replica.name)

    dns = StubDns(["10.0.0.1"], OSError("no such host"))  # type: ignore[list-item]
    discovery = Discovery(lambda: fleet, probe, dns)
    asyncio.run(discovery.refresh(force=True))
    asyncio.run(discovery.refresh(force=True))
    assert [r.name for r in fleet.pools["dense"].replicas] == ["dense-10.0.0.1-8000"]
    assert probed == ["dense-10.0.0.1-8000"]  # a new replica is probed at once
    assert dns.asked[0] == ("vllm-dense.models.svc.cluster.local", 8000)


def test_discovered_replicas_survive_a_reload() -> None:
    table = parse_table(TABLE.replace("PORT", "8000"))
    fleet = Fleet(table)
    found = table.presets["dense"].discover
    assert found is not None
    update_pool(fleet.pools["dense"], [discovered_spec("dense", found, "10.0.0.9")], table.health)
    reloaded = Fleet(parse_table(TABLE.replace("PORT", "8000")), previous=fleet)
    assert [r.name for r in reloaded.pools["dense"].replicas] == ["dense-10.0.0.9-8000"]


@pytest.fixture
def pod() -> Iterator[ThreadServer]:
    server = ThreadServer(create_app(SimConfig(engine="vllm", model="m", time_scale=0))).start()
    yield server
    server.stop()


def test_the_gateway_follows_dns_without_a_restart(pod: ThreadServer) -> None:
    port = pod.port
    dns = StubDns(["127.0.0.1"])
    with run_gateway(TABLE.replace("PORT", str(port)), resolver=dns) as gw:
        reply = httpx2.post(
            gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert reply.status_code == 200 and reply.headers["x-gateway-replica"] == f"dense-127.0.0.1-{port}"
        dns.answers = [[]]
        assert eventually(lambda: not gw.gateway.fleet.pools["dense"].replicas, timeout=5)
        reply = httpx2.post(
            gw.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert reply.status_code == 503
        dns.answers = [["127.0.0.1"]]
        assert eventually(lambda: gw.gateway.fleet.pools["dense"].ready(), timeout=5)
