"""gateway/edge/auth.py: which key a client presented, how it is compared, and the middleware that
lets the public paths through and answers everything else without a valid key with a 401 in the
client's own dialect, recorded like any other request."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import httpx2
import pytest

from gateway.edge.auth import KeyAuth, is_admin, presented_key
from gateway.fleet.stored import OPEN_OWNER, Owner
from gateway.ops.exchange import Exchange
from gateway.team.keys import OPEN, Identity, Keyring, KeySpec, build_keyring
from gateway.types import header_map
from tests.support.asgi import Downstream, call, http_scope
from tests.support.harness import one_replica_table, run_gateway

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
    assert presented_key(header_map(http_scope("/v1/models", "GET", headers))) == key


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


@pytest.mark.anyio
async def test_each_plain_key_owns_what_it_makes_the_gateway_keep_and_is_no_admin() -> None:
    inner = Downstream()
    auth = KeyAuth(inner, ring(KEYS))
    await call(auth, http_scope("/v1/responses", headers=[("x-api-key", "gw-key-one")]))
    await call(auth, http_scope("/v1/responses", headers=[("x-api-key", "gw-key-two")]))
    one, two = (Owner.of(scope) for scope in inner.scopes)
    assert one.key != two.key and one.key.startswith("anon:") and not one.admin and not two.admin
    assert "gw-key" not in one.key


@pytest.mark.anyio
async def test_a_plain_key_is_an_admin_only_when_the_setting_says_so() -> None:
    inner = Downstream()
    await call(
        KeyAuth(inner, ring(KEYS), anonymous_admin=True),
        http_scope("/v1/models", "GET", [("x-api-key", "gw-key-one")]),
    )
    assert Owner.of(inner.scopes[0]).admin


@pytest.mark.anyio
async def test_a_named_key_owns_by_its_name_and_is_an_admin_when_marked() -> None:
    digest = hashlib.sha256(b"root-secret").hexdigest()
    keyring = build_keyring(
        [
            KeySpec(name="root", key_sha256=digest, admin=True),
            KeySpec(name="alice", key_sha256=hashlib.sha256(b"alice-secret").hexdigest()),
        ]
    )
    inner = Downstream()
    auth = KeyAuth(inner, lambda: keyring)
    await call(auth, http_scope("/v1/models", "GET", [("x-api-key", "root-secret")]))
    await call(auth, http_scope("/v1/models", "GET", [("x-api-key", "alice-secret")]))
    assert [Owner.of(scope) for scope in inner.scopes] == [Owner("key:root", True), Owner("key:alice", False)]


@pytest.mark.anyio
async def test_an_open_gateways_caller_is_its_one_local_user_and_admin() -> None:
    inner = Downstream()
    await call(KeyAuth(inner, ring(frozenset())), http_scope("/v1/responses"))
    assert Owner.of(inner.scopes[0]) == OPEN_OWNER and OPEN_OWNER.admin


def test_who_is_an_admin() -> None:
    named_admin = Identity("root", admin=True)
    plain = OPEN  # every GATEWAY_API_KEYS key has the anonymous identity
    assert is_admin(named_admin, open_mode=False, anonymous_admin=False)
    assert not is_admin(Identity("alice"), open_mode=False, anonymous_admin=True)
    assert not is_admin(plain, open_mode=False, anonymous_admin=False)
    assert is_admin(plain, open_mode=False, anonymous_admin=True)
    assert is_admin(plain, open_mode=True, anonymous_admin=False)


@pytest.mark.parametrize(("anonymous_admin", "status"), [(False, 403), (True, 200)])
def test_admin_endpoints_refuse_a_plain_key_beside_named_ones_unless_the_setting_says_so(
    anonymous_admin: bool, status: int
) -> None:
    digest = hashlib.sha256(b"root-secret").hexdigest()
    table = one_replica_table(
        "http://127.0.0.1:9", extra=f"keys: [{{name: root, key_sha256: {digest}, admin: true}}]"
    )
    with run_gateway(table, api_keys="plain-key", anonymous_admin=anonymous_admin) as gw:
        plain = {"authorization": "Bearer plain-key"}
        listed = httpx2.get(gw.url + "/admin/replicas", headers=plain, timeout=10)
        assert listed.status_code == status
        stop = httpx2.post(gw.url + "/admin/replicas/r0/stop", headers=plain, timeout=10)
        assert stop.status_code == (403 if status == 403 else 404)  # r0 is not a launched replica
        if status == 403:
            assert listed.json()["error"]["code"] == "admin_only"
            assert "GATEWAY_ANONYMOUS_ADMIN" in listed.json()["error"]["message"]
        root = httpx2.get(
            gw.url + "/admin/replicas", headers={"authorization": "Bearer root-secret"}, timeout=10
        )
        assert root.status_code == 200


def test_an_open_gateway_keeps_its_admin_endpoints_for_the_local_user() -> None:
    with run_gateway(one_replica_table("http://127.0.0.1:9")) as gw:
        assert httpx2.get(gw.url + "/admin/replicas", timeout=10).status_code == 200
