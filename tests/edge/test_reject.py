"""gateway/edge/reject.py: what the edge turns away is answered in the path's dialect and recorded as
a rejected request with a bounded endpoint label, the caller's identity where known, and the time it
was given, even when the answer cannot be sent."""

from __future__ import annotations

import pytest

from gateway.dialects.registry import ENDPOINTS
from gateway.edge.reject import endpoint_label, reject
from gateway.errors import MethodNotAllowed, NotFound, QueueFull, Unauthorized
from gateway.ops.exchange import Exchange
from gateway.team.keys import OPEN, Identity
from gateway.types import Message
from tests.support.asgi import Sent, http_scope

REGISTRY_PATHS = [(path, e.name) for e in ENDPOINTS for path in (e.path, *e.aliases)]


class Recorded(list[Exchange]):
    def __call__(self, ex: Exchange) -> None:
        self.append(ex)


@pytest.mark.parametrize(("path", "name"), REGISTRY_PATHS, ids=[path for path, _ in REGISTRY_PATHS])
def test_a_registry_path_is_labelled_with_its_endpoints_name(path: str, name: str) -> None:
    assert endpoint_label(path) == name


def test_a_stored_answers_path_is_labelled_as_one_whatever_its_id() -> None:
    assert endpoint_label("/v1/responses/resp_abc") == "responses_stored"
    assert endpoint_label("/v1/responses/resp_abc/cancel") == "responses_stored"


@pytest.mark.parametrize(
    "path", ["/", "/v2/chat", "/admin/reload", "/v1/chat/completions/x", "/" + "a" * 500]
)
def test_any_other_path_is_one_bounded_label(path: str) -> None:
    assert endpoint_label(path) == "other"


@pytest.mark.anyio
async def test_a_refusal_on_messages_is_in_anthropics_envelope_and_recorded() -> None:
    sent, recorded = Sent(), Recorded()
    scope = http_scope("/v1/messages", client=("10.1.2.3", 5000))
    await reject(scope, sent, Unauthorized("Missing API key"), recorded, 42.0)
    assert sent.status == 401 and sent.headers["www-authenticate"] == "Bearer"
    assert sent.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Missing API key"},
    }
    [ex] = recorded
    assert (ex.endpoint, ex.outcome, ex.status, ex.error_code) == (
        "messages",
        "rejected",
        401,
        "invalid_api_key",
    )
    assert (ex.started, ex.finished, ex.client) == (42.0, 42.0, "10.1.2.3")
    assert sent.headers["x-request-id"] == ex.request_id and len(ex.request_id) == 16


@pytest.mark.anyio
async def test_a_refusal_on_any_other_path_is_in_openais_envelope() -> None:
    sent, recorded = Sent(), Recorded()
    await reject(http_scope("/nowhere", "GET"), sent, NotFound("No such path"), recorded, 1.0)
    assert sent.status == 404
    assert sent.json() == {
        "error": {
            "message": "No such path",
            "type": "invalid_request_error",
            "code": "not_found",
            "param": None,
        }
    }
    assert recorded[0].endpoint == "other"


@pytest.mark.anyio
async def test_the_errors_own_headers_go_out_with_the_refusal() -> None:
    sent = Sent()
    error = MethodNotAllowed("use POST", headers={"allow": "POST"})
    await reject(http_scope("/v1/chat/completions", "GET"), sent, error, None, 0.0)
    assert sent.status == 405 and sent.headers["allow"] == "POST"
    assert "www-authenticate" not in sent.headers


@pytest.mark.anyio
async def test_the_callers_identity_is_recorded_when_the_key_check_named_it() -> None:
    recorded = Recorded()
    scope = http_scope("/v1/chat/completions")
    scope["gateway.identity"] = Identity("alice")
    await reject(scope, Sent(), QueueFull("busy"), recorded, 0.0)
    assert recorded[0].identity.name == "alice" and recorded[0].key == "alice"


@pytest.mark.anyio
async def test_a_request_turned_away_before_the_key_check_is_recorded_as_the_anonymous_caller() -> None:
    recorded = Recorded()
    await reject(http_scope("/v1/chat/completions"), Sent(), Unauthorized("no key"), recorded, 0.0)
    assert recorded[0].identity is OPEN


@pytest.mark.anyio
async def test_a_scope_without_a_client_address_records_none() -> None:
    recorded = Recorded()
    await reject(http_scope("/v1/chat/completions", client=None), Sent(), Unauthorized("x"), recorded, 0.0)
    assert recorded[0].client == ""


@pytest.mark.anyio
async def test_the_refusal_is_recorded_even_when_the_client_is_gone() -> None:
    recorded = Recorded()

    async def broken(message: Message) -> None:
        raise OSError("the client closed the connection")

    with pytest.raises(OSError, match="closed the connection"):
        await reject(http_scope("/v1/messages"), broken, Unauthorized("x"), recorded, 9.0)
    [ex] = recorded
    assert (ex.outcome, ex.finished, ex.endpoint) == ("rejected", 9.0, "messages")


@pytest.mark.anyio
async def test_without_a_recorder_the_refusal_is_still_answered() -> None:
    sent = Sent()
    await reject(http_scope("/v1/chat/completions"), sent, Unauthorized("x"), None, 0.0)
    assert sent.status == 401


@pytest.mark.anyio
async def test_each_refusal_gets_its_own_request_id() -> None:
    recorded = Recorded()
    for _ in range(2):
        await reject(http_scope("/v1/chat/completions"), Sent(), Unauthorized("x"), recorded, 0.0)
    assert recorded[0].request_id != recorded[1].request_id
