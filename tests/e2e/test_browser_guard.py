"""An open gateway on loopback serves loopback Host names only and refuses the
content types a web page may POST cross-site without a preflight; CORS only for listed origins.

Over real sockets to the gateway as shipped (uvicorn, httptools), in front of a simulated replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx2
import pytest

from gateway.edge.browser import host_name, same_origin
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


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_open_mode_refuses_a_page_post_without_content_type(open_gw: Running, path: str) -> None:
    # What a page's fetch() with a Blob body sends: no Content-Type, so no preflight; and, as every
    # browser POST does, an Origin.
    cross_site = post(open_gw, path, CHAT, origin="https://evil.example")
    assert cross_site.status_code == 403
    port = open_gw.url.rsplit(":", 1)[1]
    own_page = post(open_gw, path, CHAT, origin=f"http://127.0.0.1:{port}", host=f"127.0.0.1:{port}")
    assert own_page.status_code == 415 and "no Content-Type" in own_page.text


def test_open_mode_refuses_any_post_body_without_content_type(open_gw: Running) -> None:
    # No Origin either (curl -d without -H, a script): a body must still say it is JSON.
    answer = post(open_gw, "/v1/chat/completions", CHAT)
    assert answer.status_code == 415 and "no Content-Type" in answer.text


def test_open_mode_serves_a_bodyless_post_without_content_type(open_gw: Running) -> None:
    # An admin action or a cancel carries no body a page could smuggle: refused only from a foreign Origin.
    answer = httpx2.post(open_gw.url + "/admin/replicas/nobody/stop")
    assert answer.status_code == 404  # reached the handler: no launched replica of that name


@pytest.mark.parametrize("content_type", ["application/octet-stream", "text/html", "application/xml"])
def test_open_mode_refuses_any_other_post_body_type(open_gw: Running, content_type: str) -> None:
    answer = post(open_gw, "/v1/chat/completions", CHAT, **{"content-type": content_type})
    assert answer.status_code == 415


def test_open_mode_serves_json_types(open_gw: Running) -> None:
    for content_type in ("application/json", "application/json; charset=utf-8", "application/vnd.x+json"):
        answer = post(open_gw, "/v1/chat/completions", CHAT, **{"content-type": content_type})
        assert answer.status_code == 200, (content_type, answer.text)


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://localhost:5173"])
def test_open_mode_refuses_a_foreign_origin_even_a_bodyless_admin_post(open_gw: Running, origin: str) -> None:
    stop = httpx2.post(
        open_gw.url + "/admin/replicas/r0/stop", headers={"origin": origin, "host": "127.0.0.1"}, timeout=10
    )
    assert stop.status_code == 403 and stop.json()["error"]["code"] == "origin_not_allowed"
    chat = post(
        open_gw, "/v1/chat/completions", CHAT, **{"origin": origin, "content-type": "application/json"}
    )
    assert chat.status_code == 403
    models = httpx2.get(open_gw.url + "/v1/models", headers={"origin": origin}, timeout=10)
    assert models.status_code == 403  # a GET's answer is as readable to the page as a POST's


def test_open_mode_serves_its_own_origin_and_a_listed_one() -> None:
    with gateway(cors_origins="http://localhost:5173") as gw:
        port = gw.url.rsplit(":", 1)[1]
        own = post(
            gw,
            "/v1/chat/completions",
            CHAT,
            **{
                "origin": f"http://127.0.0.1:{port}",
                "host": f"127.0.0.1:{port}",
                "content-type": "application/json",
            },
        )
        assert own.status_code == 200, own.text
        listed = post(
            gw,
            "/v1/chat/completions",
            CHAT,
            **{"origin": "http://localhost:5173", "content-type": "application/json"},
        )
        assert listed.status_code == 200, listed.text
        other = post(
            gw,
            "/v1/chat/completions",
            CHAT,
            **{"origin": "http://localhost:5174", "content-type": "application/json"},
        )
        assert other.status_code == 403


def test_with_keys_the_origin_is_left_to_cors_and_the_key() -> None:
    with gateway(api_keys="k1") as gw:
        answer = post(
            gw,
            "/v1/chat/completions",
            CHAT,
            **{
                "origin": "https://tool.example",
                "content-type": "application/json",
                "authorization": "Bearer k1",
            },
        )
        assert answer.status_code == 200


@pytest.mark.parametrize(
    ("origin", "host", "same"),
    [
        ("http://127.0.0.1:18000", "127.0.0.1:18000", True),
        ("http://localhost", "localhost:80", True),
        ("https://gw.lan", "gw.lan:443", True),
        ("http://localhost:18000", "127.0.0.1:18000", False),
        ("http://127.0.0.1:18001", "127.0.0.1:18000", False),
        ("null", "127.0.0.1:18000", False),
        ("file://", "127.0.0.1", False),
        ("http://127.0.0.1:18000", "", False),
    ],
)
def test_same_origin_is_the_host_the_request_names(origin: str, host: str, same: bool) -> None:
    assert same_origin(origin, host) is same
