"""gateway/relay/respond.py: the gateway's own error in each dialect's envelope, sent through a
recorded ASGI `send`, and a replica's 4xx passed on with its status and a scrubbed message."""

from __future__ import annotations

import orjson
import pytest

from gateway.dialects.anthropic import ANTHROPIC
from gateway.dialects.base import Dialect
from gateway.dialects.openai import OPENAI
from gateway.dialects.responses import RESPONSES
from gateway.errors import GatewayError, NoUpstream, QueueFull, Unauthorized
from gateway.ops.exchange import Exchange
from gateway.relay.replica_message import FORWARDED_MESSAGE_LIMIT, scrub, upstream_error_body
from gateway.relay.respond import send_error
from tests.support.asgi import Sent


def exchange(**fields: object) -> Exchange:
    return Exchange(request_id="req-7", endpoint="chat", started=0.0, **fields)  # type: ignore[arg-type]


# --- send_error -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_send_error_in_the_openai_envelope() -> None:
    sent, ex = Sent(), exchange()
    error = QueueFull("Preset 'm' is at capacity", headers={"retry-after": "1"})
    await send_error(sent, ex, error, OPENAI)
    assert [m["type"] for m in sent.messages] == ["http.response.start", "http.response.body"]
    assert sent.status == 429
    assert sent.json() == {
        "error": {
            "message": "Preset 'm' is at capacity",
            "type": "rate_limit_exceeded",
            "code": "queue_full",
            "param": None,
        }
    }
    headers = sent.headers
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(sent.body))
    assert headers["x-request-id"] == "req-7" and headers["retry-after"] == "1"
    assert "www-authenticate" not in headers
    assert "x-gateway-preset" not in headers  # no preset was routed to
    assert (ex.status, ex.error_code) == (429, "queue_full")  # the record has the status that went out


@pytest.mark.anyio
async def test_send_error_in_the_anthropic_envelope() -> None:
    sent, ex = Sent(), exchange(preset="m", route="alias")
    await send_error(
        sent, ex, NoUpstream("No replica could be reached", headers={"retry-after": "5"}), ANTHROPIC
    )
    assert sent.status == 503
    assert sent.json() == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "No replica could be reached"},
    }
    headers = sent.headers
    assert headers["retry-after"] == "5"
    assert headers["x-gateway-preset"] == "m" and headers["x-gateway-route"] == "alias"
    assert (ex.status, ex.error_code) == (503, "no_healthy_upstream")


@pytest.mark.parametrize(
    ("dialect", "shape"),
    [
        (
            OPENAI,
            {
                "error": {
                    "message": "Invalid API key",
                    "type": "authentication_error",
                    "code": "invalid_api_key",
                    "param": None,
                }
            },
        ),
        (
            ANTHROPIC,
            {"type": "error", "error": {"type": "authentication_error", "message": "Invalid API key"}},
        ),
    ],
    ids=["openai", "anthropic"],
)
@pytest.mark.anyio
async def test_a_401_asks_for_a_bearer_token(dialect: Dialect, shape: dict[str, object]) -> None:
    sent = Sent()
    await send_error(sent, exchange(), Unauthorized("Invalid API key"), dialect)
    assert sent.status == 401 and sent.headers["www-authenticate"] == "Bearer"
    assert sent.json() == shape


@pytest.mark.anyio
async def test_send_error_names_the_replica_and_the_rewrites_it_already_knows() -> None:
    sent = Sent()
    ex = exchange(preset="m", route="model", replica="r0", rewrites=[("max_tokens", "max_tokens=1024")])
    await send_error(sent, ex, GatewayError("boom"))
    headers = sent.headers
    assert headers["x-gateway-replica"] == "r0" and headers["x-gateway-rewrites"] == "max_tokens=1024"
    assert sent.status == 500


# --- a replica's error passed on --------------------------------------------------------------


def openai_error(message: str, **extra: object) -> bytes:
    return orjson.dumps({"error": {"message": message, **extra}})


@pytest.mark.parametrize(
    ("message", "leak"),
    [
        ("cannot reach http://10.0.0.7:8000/v1/models", "10.0.0.7"),
        ("upstream https://vllm-0.internal:8000/v1 failed", "vllm-0.internal"),
        ("peer 192.168.4.20:8081 closed", "192.168.4.20"),
        ("header was Bearer sk-live-abcdef123456", "sk-live-abcdef123456"),
        ("bad key sk-proj_ABCDEFGH1234 given", "sk-proj_ABCDEFGH1234"),
        ("query had api_key=hunter2 in it", "hunter2"),
        ("token=abc.def.ghi expired", "abc.def.ghi"),
        ("password=swordfish rejected", "swordfish"),
    ],
)
def test_upstream_error_body_scrubs_addresses_and_credentials(message: str, leak: str) -> None:
    body = orjson.loads(upstream_error_body(400, openai_error(message), "req-7"))
    assert leak not in body["error"]["message"]
    assert "[address]" in body["error"]["message"] or "[redacted]" in body["error"]["message"]


def test_upstream_error_body_redacts_the_replicas_own_key() -> None:
    raw = openai_error("key replica-secret-123 is not valid for this model")
    body = orjson.loads(upstream_error_body(401, raw, "req-7", ("replica-secret-123",)))
    assert body["error"]["message"] == "key [redacted] is not valid for this model"


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (openai_error("too long", type="BadRequestError"), 400),  # no code given: the status
        (
            openai_error("too long", type="BadRequestError", code="context_length_exceeded"),
            "context_length_exceeded",
        ),
        (openai_error("too long", code=True), 400),  # a boolean is not a code
    ],
)
def test_upstream_error_body_keeps_the_message_and_the_status_as_code(raw: bytes, code: object) -> None:
    body = orjson.loads(upstream_error_body(400, raw, "req-7"))
    assert body["error"]["message"] == "too long" and body["error"]["code"] == code


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
    ],
)
def test_upstream_error_body_in_anthropic_shape_types_it_by_status(status: int, kind: str) -> None:
    body = orjson.loads(upstream_error_body(status, openai_error("nope"), "req-7", dialect=ANTHROPIC))
    assert body == {"type": "error", "error": {"type": kind, "message": "nope"}}


def test_a_flat_old_vllm_error_is_read_in_every_dialect() -> None:
    raw = orjson.dumps({"message": "model does not exist", "object": "error"})
    for dialect in (OPENAI, ANTHROPIC, RESPONSES):
        body = orjson.loads(upstream_error_body(404, raw, "req-7", dialect=dialect))
        assert body["error"]["message"] == "model does not exist"


@pytest.mark.parametrize("raw", [b"<html>502 Bad Gateway</html>", b"", b"[]", openai_error("")])
def test_upstream_error_body_without_a_message_says_the_status(raw: bytes) -> None:
    body = orjson.loads(upstream_error_body(422, raw, "req-7"))
    assert body["error"]["message"] == "The replica answered 422"
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 422


def test_upstream_error_body_bounds_the_message_and_the_type() -> None:
    raw = openai_error("x" * (FORWARDED_MESSAGE_LIMIT * 2), type="t" * 65)
    body = orjson.loads(upstream_error_body(400, raw, "req-7"))
    assert len(body["error"]["message"]) == FORWARDED_MESSAGE_LIMIT
    assert body["error"]["type"] == "invalid_request_error"


def test_scrub_leaves_an_ordinary_message_alone() -> None:
    text = "'max_tokens' must be at most 4096 (this model's context is 8192 tokens)"
    assert scrub(text, ("",)) == text
