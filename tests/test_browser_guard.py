"""Issue 15 item 10: an open gateway on loopback serves loopback Host names only and refuses the
content types a web page may POST cross-site without a preflight; CORS only for listed origins.

Over real sockets to the gateway as shipped (uvicorn, httptools), in front of a simulated replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx2
import pytest

from gateway.edge.browser import host_name
from tests.support.harness import Running, eventually, one_replica_table, run_gateway
from tests.support.servers import sim_replica

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}'


@contextmanager
def gateway(**settings: Any) -> Iterator[Running]:
    replica = sim_replica("vllm", "m")
    try:
        with run_gateway(one_replica_table(replica.url), **settings) as running:
            yield running
    finally:
        replica.stop()


@pytest.fixture
def open_gw() -> Iterator[Running]:
    with gateway() as running:
        yield running


def post(gw: Running, path: str, body: bytes, **headers: str) -> httpx2.Response:
    return httpx2.post(gw.url + path, content=body, headers=headers, timeout=10)


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("localhost:18000", "localhost"),
        ("[::1]:80", "[::1]"),
        ("Evil.Example:80", "evil.example"),
        ("::1", "::1"),
    ],
)
def test_host_name_drops_the_port(value: str, name: str) -> None:
    assert host_name(value) == name


def test_open_loopback_gateway_refuses_a_rebound_host_name(open_gw: Running) -> None:
    answer = post(
        open_gw, "/v1/messages", CHAT, **{"host": "attacker.example", "content-type": "application/json"}
    )
    assert answer.status_code == 403
    assert answer.json()["type"] == "error"  # in the Messages dialect of the path
    assert "GATEWAY_ALLOWED_HOSTS" in answer.json()["error"]["message"]
    entries = eventually(lambda: [e for e in open_gw.log_entries() if e.get("status") == 403])
    assert entries and entries[0]["error_code"] == "host_not_allowed"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:18000", "[::1]:9"])
def test_loopback_names_are_served(open_gw: Running, host: str) -> None:
    answer = post(open_gw, "/v1/chat/completions", CHAT, **{"host": host, "content-type": "application/json"})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ],
)
def test_open_mode_refuses_browser_simple_content_types(open_gw: Running, content_type: str) -> None:
    answer = post(open_gw, "/v1/chat/completions", CHAT, **{"content-type": content_type})
    assert answer.status_code == 415
    assert "application/json" in answer.json()["error"]["message"]
    assert answer.json()["error"]["code"] == "unsupported_media_type"


def test_a_listed_host_is_served_and_star_allows_any() -> None:
    with gateway(allowed_hosts="gateway.lan, fleet.internal:18000") as gw:
        ok = post(
            gw, "/v1/chat/completions", CHAT, **{"host": "fleet.internal", "content-type": "application/json"}
        )
        assert ok.status_code == 200
        refused = post(
            gw, "/v1/chat/completions", CHAT, **{"host": "other.lan", "content-type": "application/json"}
        )
        assert refused.status_code == 403
    with gateway(allowed_hosts="*") as gw:
        ok = post(
            gw, "/v1/chat/completions", CHAT, **{"host": "anything", "content-type": "application/json"}
        )
        assert ok.status_code == 200


def test_with_keys_any_host_and_content_type_reach_auth() -> None:
    with gateway(api_keys="k1") as gw:
        answer = post(
            gw, "/v1/chat/completions", CHAT, **{"host": "gateway.lan", "content-type": "text/plain"}
        )
        assert answer.status_code == 401  # the key check decides, not the browser guard
        answer = post(
            gw,
            "/v1/chat/completions",
            CHAT,
            **{"host": "gateway.lan", "content-type": "application/json", "authorization": "Bearer k1"},
        )
        assert answer.status_code == 200


def test_a_non_loopback_bind_serves_any_host() -> None:
    # A container binds 0.0.0.0 behind a Service or a proxy: the Host is the proxy's name.
    with gateway(host="0.0.0.0") as gw:
        answer = post(
            gw, "/v1/chat/completions", CHAT, **{"host": "fleet.svc", "content-type": "application/json"}
        )
        assert answer.status_code == 200
        refused = post(gw, "/v1/chat/completions", CHAT, **{"content-type": "text/plain"})
        assert refused.status_code == 415  # still open mode


def test_cors_only_for_listed_origins() -> None:
    with gateway(cors_origins="http://localhost:5173", api_keys="k1") as gw:
        preflight = httpx2.options(
            gw.url + "/v1/chat/completions",
            headers={
                "origin": "http://localhost:5173",
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
            timeout=10,
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:5173"
        other = httpx2.options(
            gw.url + "/v1/chat/completions",
            headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
            timeout=10,
        )
        assert "access-control-allow-origin" not in other.headers
        answer = post(
            gw,
            "/v1/chat/completions",
            CHAT,
            **{
                "origin": "http://localhost:5173",
                "content-type": "application/json",
                "authorization": "Bearer k1",
            },
        )
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "http://localhost:5173"
    with gateway() as gw:
        answer = post(
            gw,
            "/v1/chat/completions",
            CHAT,
            **{"origin": "http://localhost:5173", "content-type": "application/json"},
        )
        assert "access-control-allow-origin" not in answer.headers
