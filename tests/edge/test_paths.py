"""gateway/edge/paths.py: the registry's paths go to the proxy's handler (POST only), one stored
response's paths to the stored handler, and everything else to the fallback app."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.dialects.registry import ENDPOINTS, Endpoint
from gateway.edge.paths import Paths
from gateway.ops.exchange import Exchange
from gateway.types import Receive, Scope, Send
from tests.support.asgi import Downstream, call, http_scope


@dataclass
class Calls:
    handled: list[tuple[str, str]] = field(default_factory=list)  # (endpoint name, path)
    stored: list[tuple[str, str]] = field(default_factory=list)  # (response id, method)
    recorded: list[Exchange] = field(default_factory=list)
    fallback: Downstream = field(default_factory=Downstream)

    async def handle(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        self.handled.append((endpoint.name, scope["path"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"handled"})

    async def store(self, response_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        self.stored.append((response_id, scope["method"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"stored"})

    def dispatch(self) -> Paths:
        return Paths(self.handle, self.store, self.fallback, self.recorded.append, clock=lambda: 3.0)

    def fell_back(self) -> list[str]:
        return [scope["path"] for scope in self.fallback.scopes]


REGISTRY_PATHS = [
    (path, endpoint.name) for endpoint in ENDPOINTS for path in (endpoint.path, *endpoint.aliases)
]


@pytest.mark.parametrize(("path", "name"), REGISTRY_PATHS, ids=[path for path, _ in REGISTRY_PATHS])
@pytest.mark.anyio
async def test_a_registry_path_goes_to_the_handler_with_its_endpoint(path: str, name: str) -> None:
    calls = Calls()
    sent = await call(calls.dispatch(), http_scope(path, "POST"))
    assert sent.body == b"handled" and calls.handled == [(name, path)]
    assert calls.stored == [] and calls.fell_back() == [] and calls.recorded == []


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "HEAD"])
@pytest.mark.anyio
async def test_any_other_method_on_messages_is_a_405_with_allow(method: str) -> None:
    calls = Calls()
    sent = await call(calls.dispatch(), http_scope("/v1/messages", method))
    assert sent.status == 405 and sent.headers["allow"] == "POST"
    body = sent.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"  # Anthropic's shape
    assert method in body["error"]["message"]
    assert calls.handled == [] and calls.fell_back() == []
    [ex] = calls.recorded
    assert (ex.status, ex.endpoint, ex.outcome, ex.error_code) == (
        405,
        "messages",
        "rejected",
        "method_not_allowed",
    )


@pytest.mark.anyio
async def test_a_get_on_chat_is_a_405_in_the_openai_shape() -> None:
    calls = Calls()
    sent = await call(calls.dispatch(), http_scope("/v1/chat/completions", "GET"))
    assert sent.status == 405 and sent.json()["error"]["code"] == "method_not_allowed"
    assert [ex.endpoint for ex in calls.recorded] == ["chat"]


@pytest.mark.parametrize(
    ("method", "path", "stored"),
    [
        ("GET", "/v1/responses/resp_abc", ("resp_abc", "GET")),
        ("DELETE", "/v1/responses/resp_abc", ("resp_abc", "DELETE")),
        ("POST", "/v1/responses/resp_abc/cancel", ("resp_abc", "POST")),
        ("GET", "/v1/responses/cancel", ("cancel", "GET")),  # an id that happens to read "cancel"
    ],
)
@pytest.mark.anyio
async def test_one_stored_responses_paths_go_to_the_stored_handler(
    method: str, path: str, stored: tuple[str, str]
) -> None:
    calls = Calls()
    sent = await call(calls.dispatch(), http_scope(path, method))
    assert sent.body == b"stored" and calls.stored == [stored]
    assert calls.handled == [] and calls.fell_back() == []


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("POST", "/v1/responses/resp_abc", "GET, DELETE"),
        ("PUT", "/v1/responses/resp_abc", "GET, DELETE"),
        ("GET", "/v1/responses/resp_abc/cancel", "POST"),
        ("DELETE", "/v1/responses/resp_abc/cancel", "POST"),
    ],
)
@pytest.mark.anyio
async def test_a_wrong_method_on_a_stored_response_is_a_405(method: str, path: str, allow: str) -> None:
    calls = Calls()
    sent = await call(calls.dispatch(), http_scope(path, method))
    assert sent.status == 405 and sent.headers["allow"] == allow
    assert calls.stored == [] and calls.fell_back() == []
    assert [(ex.status, ex.endpoint) for ex in calls.recorded] == [(405, "responses_stored")]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/"),
        ("GET", "/v1/responses/"),  # no id
        ("GET", "/v1/responses/a/b"),  # not one response
        ("POST", "/v1/responses//cancel"),
        ("POST", "/v1/chat/completions/"),  # not the registry's path
        ("POST", "/v1/unknown"),
    ],
)
@pytest.mark.anyio
async def test_anything_else_goes_to_the_fallback(method: str, path: str) -> None:
    calls = Calls()
    sent = await call(calls.dispatch(), http_scope(path, method))
    assert sent.status == 204 and calls.fell_back() == [path]
    assert calls.handled == [] and calls.stored == [] and calls.recorded == []


@pytest.mark.anyio
async def test_a_lifespan_scope_goes_to_the_fallback() -> None:
    calls = Calls()
    seen: list[Any] = []

    async def fallback(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    await Paths(calls.handle, calls.store, fallback)({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan"] and calls.handled == []
