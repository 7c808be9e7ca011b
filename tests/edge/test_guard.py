"""gateway/edge/guard.py: requests with too many or too large headers get a 431 before anything
else reads them, recorded like any other request."""

from __future__ import annotations

import pytest

from gateway.edge.guard import HeaderLimits
from gateway.ops.exchange import Exchange
from tests.support.asgi import Downstream, call, http_scope

MAX_BYTES, MAX_COUNT = 200, 5


def sized(count: int, value_bytes: int = 1) -> list[tuple[str, str]]:
    """`count` headers named h0.. whose names and values add up to count * (2 + value_bytes) bytes
    (for count <= 10)."""
    return [(f"h{i}", "v" * value_bytes) for i in range(count)]


class Recorded(list[Exchange]):
    def __call__(self, ex: Exchange) -> None:
        self.append(ex)


@pytest.mark.parametrize(
    ("headers", "allowed"),
    [
        ([], True),
        (sized(MAX_COUNT), True),  # at the limit
        (sized(MAX_COUNT + 1), False),
        (sized(4, 48), True),  # 4 * 50 = 200 bytes: at the limit
        ([*sized(3, 48), ("h3", "v" * 49)], False),  # 201 bytes
        ([("x-big", "v" * 10_000)], False),  # one huge header
    ],
    ids=["none", "count-at-limit", "count-over", "bytes-at-limit", "bytes-over", "one-huge"],
)
@pytest.mark.anyio
async def test_header_limits(headers: list[tuple[str, str]], allowed: bool) -> None:
    inner, recorded = Downstream(), Recorded()
    guard = HeaderLimits(inner, MAX_BYTES, MAX_COUNT, recorded)
    sent = await call(guard, http_scope("/v1/chat/completions", headers=headers))
    if allowed:
        assert sent.status == 204 and len(inner.scopes) == 1 and recorded == []
    else:
        assert sent.status == 431 and inner.scopes == []
        assert [(ex.status, ex.error_code) for ex in recorded] == [(431, "headers_too_large")]


@pytest.mark.anyio
async def test_a_431_is_in_the_clients_dialect_and_recorded_with_its_endpoint() -> None:
    recorded = Recorded()
    guard = HeaderLimits(Downstream(), MAX_BYTES, MAX_COUNT, recorded, clock=lambda: 7.0)
    sent = await call(guard, http_scope("/v1/messages", headers=sized(MAX_COUNT + 1)))
    body = sent.json()
    assert sent.status == 431 and body["type"] == "error"
    assert f"{MAX_COUNT} fields or {MAX_BYTES} bytes" in body["error"]["message"]
    [ex] = recorded
    assert (ex.endpoint, ex.outcome, ex.started, ex.finished) == ("messages", "rejected", 7.0, 7.0)
    assert sent.headers["x-request-id"] == ex.request_id


@pytest.mark.anyio
async def test_a_431_on_an_openai_path_has_the_openai_envelope() -> None:
    sent = await call(
        HeaderLimits(Downstream(), MAX_BYTES, MAX_COUNT), http_scope("/v1/models", "GET", sized(9))
    )
    assert sent.status == 431
    assert sent.json()["error"]["code"] == "headers_too_large"


@pytest.mark.anyio
async def test_a_lifespan_scope_is_not_checked() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, str], receive: object, send: object) -> None:
        seen.append(scope["type"])

    await HeaderLimits(app, 1, 1)({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan"]
