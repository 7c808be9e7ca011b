"""/mcp's gate over real sockets, in front of a simulated replica: each session belongs to the key
that opened it, a key's sessions and all sessions are capped (the least recently used idle one
makes way), and a body too large or too slow gets a JSON-RPC error, not a held socket."""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from tests.support.harness import Running, eventually, run_gateway
from tests.support.rawhttp import address_of, send_raw
from tests.support.servers import ThreadServer, sim_replica

VERSION = "2025-06-18"
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": VERSION, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
}
PING = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
ACCEPT = "application/json, text/event-stream"


def secret(name: str) -> str:
    return f"{name}-mcp-key"


def table(url: str) -> str:
    keys = [
        {
            "name": name,
            "key_sha256": hashlib.sha256(secret(name).encode()).hexdigest(),
            "admin": name == "root",
        }
        for name in ("alice", "bob", "root")
    ]
    return json.dumps(
        {
            "presets": {
                "m": {"served_model": "m", "replicas": [{"name": "r0", "url": url, "engine": "vllm"}]}
            },
            "routing": {"default": "m"},
            "keys": keys,
        }
    )


@pytest.fixture(scope="module")
def replica() -> Iterator[ThreadServer]:
    server = sim_replica("vllm", "m")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gw(replica: ThreadServer) -> Iterator[Running]:
    with run_gateway(
        table(replica.url),
        mcp_sessions_per_key=3,
        mcp_sessions=8,
        mcp_max_body_bytes=64 * 1024,
        body_timeout=1.0,
    ) as running:
        yield running


def headers(who: str, session: str | None = None) -> dict[str, str]:
    found = {"authorization": f"Bearer {secret(who)}", "content-type": "application/json", "accept": ACCEPT}
    if session is not None:
        found |= {"mcp-session-id": session, "mcp-protocol-version": VERSION}
    return found


def open_session(gw: Running, who: str) -> httpx2.Response:
    return httpx2.post(gw.url + "/mcp", json=INITIALIZE, headers=headers(who), timeout=10)


def session_of(gw: Running, who: str) -> str:
    answer = open_session(gw, who)
    assert answer.status_code == 200, answer.text
    return answer.headers["mcp-session-id"]


def ping(gw: Running, who: str, session: str) -> httpx2.Response:
    return httpx2.post(gw.url + "/mcp", json=PING, headers=headers(who, session), timeout=10)


def delete(gw: Running, who: str, session: str) -> httpx2.Response:
    return httpx2.delete(gw.url + "/mcp", headers=headers(who, session), timeout=10)


def jsonrpc_error(answer: httpx2.Response) -> dict[str, Any]:
    assert answer.headers["content-type"].startswith("application/json"), answer.text
    payload = answer.json()
    assert payload["jsonrpc"] == "2.0" and payload["id"] is None
    error: dict[str, Any] = payload["error"]
    return error


def test_another_key_can_neither_use_nor_end_a_session(gw: Running) -> None:
    mine = session_of(gw, "alice")
    used = ping(gw, "bob", mine)
    assert used.status_code == 404 and jsonrpc_error(used)["message"] == "Session not found"
    ended = delete(gw, "bob", mine)
    assert ended.status_code == 404
    assert ping(gw, "alice", mine).status_code == 200  # still alice's, still open
    assert delete(gw, "alice", mine).status_code == 200
    assert ping(gw, "alice", mine).status_code == 404


def test_an_admin_key_may_end_any_session(gw: Running) -> None:
    theirs = session_of(gw, "bob")
    assert delete(gw, "root", theirs).status_code == 200
    assert ping(gw, "bob", theirs).status_code == 404


def test_a_key_that_opens_sessions_without_end_replaces_its_own_oldest_and_others_still_open(
    gw: Running,
) -> None:
    flood = [session_of(gw, "alice") for _ in range(20)]
    # The cap is 3: alice's last three are open, every earlier one was closed to make way.
    assert [ping(gw, "alice", s).status_code for s in flood[-3:]] == [200, 200, 200]
    assert ping(gw, "alice", flood[0]).status_code == 404
    bob = session_of(gw, "bob")
    assert ping(gw, "bob", bob).status_code == 200
    assert _sdk_sessions(gw) <= 8  # what the SDK holds in memory stays within the total cap


def test_a_key_whose_sessions_are_all_busy_is_refused_with_a_json_rpc_429(gw: Running) -> None:
    held = [session_of(gw, "bob") for _ in range(3)]
    streams = []
    try:
        for session in held:
            # An open GET stream is a request in flight (counted before the SDK answers its head):
            # the session is not idle.
            stream = httpx2.stream(
                "GET", gw.url + "/mcp", headers={**headers("bob", session), "accept": "text/event-stream"}
            )
            response = stream.__enter__()
            assert response.status_code == 200
            streams.append(stream)
        refused = open_session(gw, "bob")
        assert refused.status_code == 429 and refused.headers["retry-after"]
        assert "GATEWAY_MCP_SESSIONS_PER_KEY" in jsonrpc_error(refused)["message"]
        assert open_session(gw, "alice").status_code == 200
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)
    entries = eventually(lambda: [e for e in gw.log_entries() if e.get("error_code") == "too_many_sessions"])
    assert entries and entries[-1]["status"] == 429 and entries[-1]["endpoint"] == "mcp"


def test_a_body_over_the_limit_gets_a_json_rpc_413(gw: Running) -> None:
    big = {**PING, "params": {"pad": "x" * (65 * 1024)}}
    answer = httpx2.post(gw.url + "/mcp", json=big, headers=headers("alice"), timeout=10)
    assert answer.status_code == 413
    assert "larger than 65536 bytes" in jsonrpc_error(answer)["message"]


def test_a_trickled_body_gets_a_json_rpc_408_at_the_body_deadline(gw: Running) -> None:
    head = (
        "POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"accept: {ACCEPT}\r\nauthorization: Bearer {secret('alice')}\r\ncontent-length: 4000\r\n\r\n"
    )
    with socket.create_connection(address_of(gw.url), timeout=10) as sock:
        answer = send_raw(sock, head.encode() + b'{"jsonrpc": "2.0", ', 10)  # and never the rest
    assert answer.status == 408
    error = answer.json()["error"]
    assert "did not arrive within 1 s" in error["message"]


def _sdk_sessions(gw: Running) -> int:
    """How many sessions the SDK itself holds (its memory), read from the gateway's endpoint."""
    mcp = _endpoint(gw)
    return len(mcp.sessions._server_instances)


def _endpoint(gw: Running) -> Any:
    """The McpEndpoint the app mounted (Paths' mount for /mcp)."""
    layer: Any = gw.server.config.app
    for _ in range(10):
        mounts = getattr(layer, "mounts", None)
        if mounts:
            return mounts["/mcp"]
        layer = getattr(layer, "app", None) or layer.dispatch  # middlewares, then the Door
    raise AssertionError("no /mcp mount found")
