"""gateway/edge/auth.py: which key a client presented, how it is compared, and the middleware that
lets the public paths through and answers everything else without a valid key with a 401 in the
client's own dialect, recorded like any other request."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.edge.auth import KeyAuth, presented_key
from gateway.ops.exchange import Exchange
from gateway.team.keys import Keyring, build_keyring
from tests.support.asgi import Downstream, call, http_scope

KEYS = frozenset({"gw-key-one", "gw-key-two"})


def ring(keys: frozenset[str]) -> Callable[[], Keyring]:
    keyring = build_keyring([], sorted(keys))
    return lambda: keyring


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ([("Authorization", "Bearer gw-key-one")], "gw-key-one"),
        ([("Authorization", "bearer   gw-key-one  ")], "gw-key-one"),  # scheme in any case, spaces trimmed
        ([("x-api-key", "gw-key-two")], "gw-key-two"),
        ([("x-api-key", "  gw-key-two ")], "gw-key-two"),
        (
            [("x-api-key", "from-header"), ("Authorization", "Bearer from-bearer")],
            "from-bearer",
        ),  # bearer wins
        ([("Authorization", "Bearer from-bearer"), ("x-api-key", "from-header")], "from-bearer"),
        ([("Authorization", "Basic dXNlcjpwYXNz"), ("x-api-key", "from-header")], "from-header"),
        ([("Authorization", "Bearer "), ("x-api-key", "from-header")], "from-header"),
        ([("Authorization", "Bearer")], None),
        ([("Authorization", "Bearer    ")], None),
        ([("x-api-key", "   ")], None),
        ([("x-api-key", "")], None),
        ([("Authorization", "gw-key-one")], None),  # no scheme
        ([], None),
    ],
)
def test_presented_key(headers: list[tuple[str, str]], key: str | None) -> None:
    assert presented_key(http_scope("/v1/models", "GET", headers)) == key


@pytest.mark.parametrize(
    ("presented", "matches"),
    [
        ("gw-key-one", True),
        ("gw-key-two", True),
        ("gw-key-on", False),  # a prefix
        ("gw-key-one ", False),
        ("GW-KEY-ONE", False),
        ("", False),
        ("gw-key-threé", False),
    ],
)
def test_key_matches(presented: str, matches: bool) -> None:
    assert (build_keyring([], sorted(KEYS)).identify(presented) is not None) is matches


def test_key_matches_nothing_without_keys() -> None:
    assert build_keyring([], []).identify("anything") is None


class Recorded(list[Exchange]):
    def __call__(self, ex: Exchange) -> None:
        self.append(ex)


@pytest.mark.parametrize("path", ["/health", "/ready", "/ui", "/"])
@pytest.mark.anyio
async def test_public_paths_need_no_key(path: str) -> None:
    inner, recorded = Downstream(), Recorded()
    sent = await call(KeyAuth(inner, ring(KEYS), recorded), http_scope(path, "GET"))
    assert sent.status == 204 and len(inner.scopes) == 1 and recorded == []


@pytest.mark.anyio
async def test_no_configured_keys_means_no_check() -> None:
    inner = Downstream()
    sent = await call(KeyAuth(inner, ring(frozenset())), http_scope("/v1/chat/completions"))
    assert sent.status == 204 and len(inner.scopes) == 1


@pytest.mark.parametrize(
    "headers",
    [[("Authorization", "Bearer gw-key-one")], [("x-api-key", "gw-key-two")]],
    ids=["bearer", "x-api-key"],
)
@pytest.mark.anyio
async def test_a_valid_key_passes_and_names_the_client_without_the_key(
    headers: list[tuple[str, str]],
) -> None:
    inner, recorded = Downstream(), Recorded()
    sent = await call(
        KeyAuth(inner, ring(KEYS), recorded), http_scope("/v1/chat/completions", headers=headers)
    )
    assert sent.status == 204 and recorded == []
    client = inner.scopes[0]["gateway.client"]
    assert client.startswith("key:") and len(client) == len("key:") + 8 and "gw-key" not in client


@pytest.mark.anyio
async def test_two_keys_are_two_clients() -> None:
    inner = Downstream()
    auth = KeyAuth(inner, ring(KEYS))
    await call(auth, http_scope("/v1/models", "GET", [("x-api-key", "gw-key-one")]))
    await call(auth, http_scope("/v1/models", "GET", [("x-api-key", "gw-key-two")]))
    assert inner.scopes[0]["gateway.client"] != inner.scopes[1]["gateway.client"]


@pytest.mark.anyio
async def test_a_missing_key_on_messages_is_an_anthropic_401_and_recorded() -> None:
    inner, recorded = Downstream(), Recorded()
    sent = await call(KeyAuth(inner, ring(KEYS), recorded, clock=lambda: 42.0), http_scope("/v1/messages"))
    assert inner.scopes == []
    assert sent.status == 401 and sent.headers["www-authenticate"] == "Bearer"
    body = sent.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert body["error"]["message"].startswith("Missing API key")
    [ex] = recorded
    assert (ex.status, ex.endpoint, ex.outcome, ex.error_code) == (
        401,
        "messages",
        "rejected",
        "invalid_api_key",
    )
    assert (ex.started, ex.finished, ex.client) == (42.0, 42.0, "127.0.0.1")
    assert sent.headers["x-request-id"] == ex.request_id


@pytest.mark.anyio
async def test_a_wrong_key_on_chat_is_an_openai_401_and_recorded() -> None:
    inner, recorded = Downstream(), Recorded()
    scope = http_scope("/v1/chat/completions", headers=[("Authorization", "Bearer guessed")])
    sent = await call(KeyAuth(inner, ring(KEYS), recorded), scope)
    assert inner.scopes == [] and sent.status == 401
    error = sent.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert error["message"].startswith("Invalid API key") and "guessed" not in sent.body.decode()
    [ex] = recorded
    assert (ex.status, ex.endpoint) == (401, "chat")


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/v1/models", "other"),
        ("/ui/state", "other"),
        ("/v1/responses/resp_1", "responses_stored"),
        ("/embeddings", "embeddings"),
    ],
)
@pytest.mark.anyio
async def test_a_rejection_anywhere_else_is_recorded_with_a_bounded_endpoint_label(
    path: str, label: str
) -> None:
    recorded = Recorded()
    sent = await call(KeyAuth(Downstream(), ring(KEYS), recorded), http_scope(path, "GET"))
    assert sent.status == 401
    assert [(ex.status, ex.endpoint) for ex in recorded] == [(401, label)]


@pytest.mark.anyio
async def test_a_path_that_only_looks_public_needs_a_key() -> None:
    inner = Downstream()
    for path in ("/health/", "/ui/state", "/healthz", "//health"):
        sent = await call(KeyAuth(inner, ring(KEYS)), http_scope(path, "GET"))
        assert sent.status == 401, path
    assert inner.scopes == []


@pytest.mark.anyio
async def test_a_lifespan_scope_passes_untouched() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, str], receive: object, send: object) -> None:
        seen.append(scope["type"])

    await KeyAuth(app, ring(KEYS))({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan"]
