"""A request queued before a reload goes where the new table says, never to a
replica the reload removed. Real sockets; the swap is the one `Gateway.reload` does on SIGHUP."""

from __future__ import annotations

import concurrent.futures

from gateway.fleet.replicas import Fleet
from gateway.routing.table import parse_table
from tests.support.fault_behaviours import Reply
from tests.support.faults import fault_server
from tests.support.gateway_process import chat_body
from tests.support.harness import Running, eventually, run_gateway
from tests.support.rawhttp import RawResponse, address_of, http_request

TABLE = """
presets:
  m:
    served_model: m
    limits: {{max_in_flight: 1, queue: 8}}
    replicas: [{replicas}]
routing: {{default: m}}
"""


def table(**replicas: str) -> str:
    listing = ", ".join(f'{{name: {name}, url: "{url}", engine: vllm}}' for name, url in replicas.items())
    return TABLE.format(replicas=listing)


def swap(gw: Running, text: str) -> None:
    async def reload() -> None:
        gateway = gw.gateway
        gateway.fleet = Fleet(parse_table(text, "reloaded.yaml"), gateway.clock, previous=gateway.fleet)

    gw.server.call(reload())


def send(gw: Running) -> RawResponse:
    return http_request(address_of(gw.url), "POST", "/v1/chat/completions", chat_body(), timeout=20)


def test_requests_queued_before_a_reload_go_to_the_new_tables_replica() -> None:
    with fault_server(name="A") as a, fault_server(name="B") as b:
        a.push(Reply(delay=1.5))  # holds A's only place while the others queue
        with run_gateway(table(old=a.url)) as gw, concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = pool.submit(send, gw)
            assert eventually(lambda: len(a.chat_requests) == 1)
            queued = [pool.submit(send, gw) for _ in range(3)]
            assert eventually(lambda: gw.gateway.fleet.pools["m"].queued == 3)
            swap(gw, table(new=b.url))  # the reload removes A
            answers = [future.result(timeout=20) for future in queued]
            assert first.result(timeout=20).status == 200  # the running answer finishes on A
        assert [r.status for r in answers] == [200, 200, 200]
        assert {r.header("x-gateway-replica") for r in answers} == {"new"}
        assert len(a.chat_requests) == 1 and len(b.chat_requests) == 3


def test_a_queued_request_whose_preset_a_reload_removed_gets_a_clear_503() -> None:
    with fault_server(name="A") as a:
        a.push(Reply(delay=1.5))
        renamed = table(other=a.url).replace("  m:", "  n:").replace("default: m", "default: n")
        with run_gateway(table(old=a.url)) as gw, concurrent.futures.ThreadPoolExecutor(2) as pool:
            pool.submit(send, gw)
            assert eventually(lambda: len(a.chat_requests) == 1)
            queued = pool.submit(send, gw)
            assert eventually(lambda: gw.gateway.fleet.pools["m"].queued == 1)
            swap(gw, renamed)
            answer = queued.result(timeout=20)
        assert answer.status == 503
        assert "removed by a reload" in answer.json()["error"]["message"]
        assert len(a.chat_requests) == 1
