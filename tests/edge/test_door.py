"""gateway/edge/door.py: the edge's rules over one read of the headers, in their order: header
limits, then the browser guard (Host, content type), then the key; a request that passes reaches its
handler with the headers read once, and one that does not is answered and recorded there."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from gateway.dialects.registry import Endpoint
from gateway.edge.auth import KeyAuth
from gateway.edge.browser import BrowserGuard
from gateway.edge.door import Door
from gateway.edge.paths import Paths
from gateway.ops.exchange import Exchange
from gateway.team.keys import Identity, Keyring, digest
from gateway.types import Receive, Scope, Send
from tests.support.asgi import Downstream, Sent, call, http_scope

MAX_BYTES, MAX_COUNT = 400, 8
KEY = "sk-test-alice"
GOOD = [("host", "localhost:8080"), ("authorization", f"Bearer {KEY}"), ("content-type", "application/json")]


@dataclass
class Edge:
    """A door in front of real rules, with handlers that record who reached them."""

    open_mode: bool = False
    hosts: Sequence[str] = ("gw.test",)
    handled: list[tuple[str, Scope]] = field(default_factory=list)
    recorded: list[Exchange] = field(default_factory=list)
    fallback: Downstream = field(default_factory=Downstream)

    async def handle(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        self.handled.append((endpoint.name, scope))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"handled"})

    async def store(self, response_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("no test here reaches a stored answer")

    def door(self) -> Door:
        ring = Keyring({} if self.open_mode else {digest(KEY): Identity("alice")}, names=["alice"])
        inner = Downstream()  # the rules' own ASGI wrapping is not used by the door
        guard = BrowserGuard(inner, open_mode=self.open_mode, loopback=True, hosts=self.hosts)
        auth = KeyAuth(inner, lambda: ring)
        paths = Paths(self.handle, self.store, self.fallback, self.recorded.append, clock=lambda: 1.0)
        return Door(paths, guard, auth, MAX_BYTES, MAX_COUNT, self.recorded.append, clock=lambda: 7.0)

    async def send(self, headers: Sequence[tuple[str, str]], path: str = "/v1/chat/completions") -> Sent:
        return await call(self.door(), http_scope(path, "POST", headers))


@pytest.mark.anyio
async def test_a_request_that_passes_every_rule_reaches_its_handler_with_the_headers_read_once() -> None:
    edge = Edge()
    sent = await edge.send([*GOOD, ("X-Custom", "Value")])
    assert sent.status == 200 and sent.body == b"handled" and edge.recorded == []
    [(name, scope)] = edge.handled
    assert name == "chat"
    assert scope["gateway.headers"] == {
        "host": "localhost:8080",
        "authorization": f"Bearer {KEY}",
        "content-type": "application/json",
        "x-custom": "Value",
    }
    assert scope["gateway.identity"].name == "alice"


@pytest.mark.anyio
async def test_headers_past_the_limits_are_refused_first_whatever_else_is_wrong() -> None:
    edge = Edge()
    # A Host the guard refuses and no key: the 431 still comes first.
    too_many = [("host", "elsewhere.test"), *((f"h{i}", "v") for i in range(MAX_COUNT))]
    sent = await edge.send(too_many)
    assert sent.status == 431 and edge.handled == []
    [ex] = edge.recorded
    assert (ex.status, ex.error_code, ex.outcome, ex.started) == (431, "headers_too_large", "rejected", 7.0)


@pytest.mark.anyio
async def test_one_header_too_large_is_refused() -> None:
    edge = Edge()
    sent = await edge.send([*GOOD, ("x-big", "v" * MAX_BYTES)])
    assert sent.status == 431 and edge.handled == []


@pytest.mark.anyio
async def test_a_host_the_gateway_does_not_serve_is_refused_before_the_key_is_checked() -> None:
    edge = Edge()
    sent = await edge.send([("host", "elsewhere.test")])  # and no key
    assert sent.status == 403 and sent.json()["error"]["code"] == "host_not_allowed"
    assert edge.handled == [] and [ex.error_code for ex in edge.recorded] == ["host_not_allowed"]


@pytest.mark.anyio
async def test_a_listed_host_passes_the_guard() -> None:
    edge = Edge()
    sent = await edge.send([("host", "gw.test"), *GOOD[1:]])
    assert sent.status == 200 and len(edge.handled) == 1


@pytest.mark.anyio
async def test_a_request_without_a_key_is_refused_in_the_paths_dialect_and_recorded() -> None:
    edge = Edge()
    sent = await edge.send([("host", "localhost")], path="/v1/messages")
    assert sent.status == 401 and sent.json()["type"] == "error"
    assert sent.headers["www-authenticate"] == "Bearer"
    assert edge.handled == []
    [ex] = edge.recorded
    assert (ex.endpoint, ex.error_code, ex.started, ex.finished) == ("messages", "invalid_api_key", 7.0, 7.0)


@pytest.mark.anyio
async def test_a_wrong_key_is_refused() -> None:
    edge = Edge()
    sent = await edge.send([("host", "localhost"), ("x-api-key", "sk-guessed")])
    assert sent.status == 401 and "Invalid API key" in sent.json()["error"]["message"]
    assert edge.handled == []


@pytest.mark.anyio
async def test_in_open_mode_a_web_pages_plain_text_post_is_refused_without_a_key_check() -> None:
    edge = Edge(open_mode=True, hosts=())
    sent = await edge.send([("host", "localhost"), ("content-type", "text/plain")])
    assert sent.status == 415 and edge.handled == []
    ok = await edge.send([("host", "localhost"), ("content-type", "application/json")])
    assert ok.status == 200 and edge.handled[0][1]["gateway.identity"].name != "alice"


@pytest.mark.anyio
async def test_a_path_outside_the_registry_goes_to_the_other_routes_after_the_rules() -> None:
    edge = Edge()
    refused = await edge.send([("host", "localhost")], path="/v1/models")
    assert refused.status == 401 and edge.fallback.scopes == []
    sent = await edge.send(GOOD, path="/v1/models")
    assert sent.status == 204 and [s["path"] for s in edge.fallback.scopes] == ["/v1/models"]


@pytest.mark.anyio
async def test_a_scope_that_is_not_http_goes_straight_through() -> None:
    edge = Edge()
    scope: Scope = {"type": "lifespan", "asgi": {"version": "3.0"}}
    await call(edge.door(), scope)
    assert edge.fallback.scopes == [scope] and "gateway.headers" not in scope
    assert edge.recorded == []
