"""gateway/pipeline/attempts.py: the retry budget, Retry-After, the final error a client sees, the
headers sent upstream, which replicas a request may reach, and the Dispatcher's retry on another
replica, against a scripted UpstreamClient (no sockets: the client is the module's only door out)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.dialects.registry import BY_NAME, STORED, Endpoint
from gateway.errors import GatewayError, GatewayTimeout, NoUpstream, UpstreamFailure
from gateway.fleet.health import HealthState
from gateway.fleet.replicas import Fleet, Pool, Replica
from gateway.ops.exchange import Exchange
from gateway.pipeline.attempts import (
    Attempt,
    Dispatcher,
    RetryableStatus,
    RetryBudget,
    _final_error,
    _retry_after,
    upstream_headers,
)
from gateway.routing.table import Health, ReplicaSpec, parse_table
from gateway.upstream import ConnectFailed, HeaderTimeout, Reset, Timeouts, UpstreamError

R0 = "http://127.0.0.1:9100"
R1 = "http://127.0.0.1:9101"


def table(*replicas: tuple[str, str, str], attempts: int = 2, min_concurrent: int = 10) -> str:
    members = ", ".join(f'{{name: {n}, url: "{u}", engine: {e}}}' for n, u, e in replicas)
    return f"""
presets:
  m:
    served_model: m
    retries: {{attempts: {attempts}, min_concurrent: {min_concurrent}}}
    limits: {{max_in_flight: 4, queue: 4, queue_timeout: 30}}
    replicas: [{members}]
routing: {{default: m}}
"""


def make_pool(*replicas: tuple[str, str, str], **retries: int) -> Pool:
    fleet = Fleet(parse_table(table(*replicas, **retries)), clock=lambda: 0.0)
    return fleet.pools["m"]


TWO = (("r0", R0, "vllm"), ("r1", R1, "llamacpp"))


def attempt(pool: Pool, endpoint: Endpoint | None = None, **kwargs: Any) -> Attempt:
    ex = Exchange(request_id="req-1", endpoint="chat", started=0.0, client="10.9.8.7")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return Attempt(ex, pool, endpoint or BY_NAME["chat"], body, 64, 100.0, **kwargs)


def replica(engine: str = "vllm", api_key_env: str | None = None) -> Replica:
    spec = ReplicaSpec(name="r0", url=R0, engine=engine, api_key_env=api_key_env)  # type: ignore[arg-type]
    return Replica(spec=spec, health=HealthState(Health()), max_in_flight=4, preset="m")


# --- RetryBudget ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("active", "retrying", "ratio", "min_concurrent", "allowed"),
    [
        (0, 0, 0.2, 10, True),  # the floor lets retries through when nothing is in flight
        (0, 9, 0.2, 10, True),
        (0, 10, 0.2, 10, False),  # at the floor
        (100, 19, 0.2, 10, True),  # above the floor the ratio rules: 20 in flight may retry
        (100, 20, 0.2, 10, False),
        (0, 0, 0.2, 0, False),  # no floor and nothing in flight: no retry at all
        (5, 0, 0.2, 0, True),  # 0 < 1.0
        (5, 1, 0.2, 0, False),
    ],
)
def test_retry_budget_allows_retries_below_the_larger_of_floor_and_ratio(
    active: int, retrying: int, ratio: float, min_concurrent: int, allowed: bool
) -> None:
    budget = RetryBudget()
    budget.active, budget.retrying = active, retrying
    assert budget.allow(ratio, min_concurrent) is allowed


# --- Retry-After ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5", 5.0),
        ("0", 0.0),
        ("1.5", 1.5),
        (" 2 ", 2.0),
        ("-3", 0.0),  # never a negative wait
        (None, None),
        ("", None),
        ("soon", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", None),  # an HTTP date is treated as absent
        ("7200", 3600.0),  # bounded
        ("inf", 3600.0),
        ("1e400", 3600.0),
        ("nan", None),
    ],
)
def test_retry_after_parsing(value: str | None, seconds: float | None) -> None:
    assert _retry_after(value) == seconds


# --- the final error --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind", "status", "code", "headers"),
    [
        (RetryableStatus(503, b"busy", 2.0), NoUpstream, 503, "upstream_unavailable", {"retry-after": "2"}),
        (RetryableStatus(503, b"", 7.9), NoUpstream, 503, "upstream_unavailable", {"retry-after": "7"}),
        (RetryableStatus(503, b"", None), NoUpstream, 503, "upstream_unavailable", {"retry-after": "1"}),
        (RetryableStatus(503, b"", 0.2), NoUpstream, 503, "upstream_unavailable", {"retry-after": "1"}),
        (RetryableStatus(504, b"", None), GatewayTimeout, 504, "upstream_timeout", {}),
        (RetryableStatus(502, b"", None), UpstreamFailure, 502, "bad_gateway", {}),
        (
            ConnectFailed("http://10.0.0.5:8000 refused"),
            NoUpstream,
            503,
            "no_healthy_upstream",
            {"retry-after": "5"},
        ),
        (HeaderTimeout("slow"), GatewayTimeout, 504, "upstream_timeout", {}),
        (Reset("gone"), UpstreamFailure, 502, "upstream_reset", {}),
    ],
)
def test_final_error_maps_each_upstream_failure(
    error: UpstreamError, kind: type[GatewayError], status: int, code: str, headers: dict[str, str]
) -> None:
    final = _final_error(error, attempt(make_pool(*TWO)))
    assert type(final) is kind
    assert (final.status, final.code, final.headers) == (status, code, headers)
    # The message is the gateway's own: it names the request or the preset, never the replica's words.
    assert "req-1" in final.message or "'m'" in final.message
    assert "10.0.0.5" not in final.message and str(error) not in final.message


def test_an_infinite_retry_after_still_becomes_a_503() -> None:
    # It was int(inf) in _final_error: OverflowError, and the client got a 500 instead of the 503.
    final = _final_error(RetryableStatus(503, b"", _retry_after("inf")), attempt(make_pool(*TWO)))
    assert final.status == 503 and final.headers["retry-after"] == "3600"


# --- upstream headers -------------------------------------------------------------------------


def names(headers: list[tuple[str, str]]) -> list[str]:
    return [name for name, _ in headers]


def test_upstream_headers_carry_the_replicas_key_and_no_client_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ex = Exchange(request_id="req-1", endpoint="chat", started=0.0, client="10.9.8.7")
    without = upstream_headers(ex, replica())
    assert "authorization" not in names(without) and "x-api-key" not in names(without)
    monkeypatch.setenv("REPLICA_KEY", "replica-secret")
    with_key = upstream_headers(ex, replica(api_key_env="REPLICA_KEY"))
    assert [v for k, v in with_key if k == "authorization"] == ["Bearer replica-secret"]
    assert "x-api-key" not in names(with_key)
    assert ("x-request-id", "req-1") in with_key
    assert ("x-forwarded-for", "10.9.8.7") in with_key


def test_upstream_headers_without_a_client_address_send_no_forwarded_for() -> None:
    ex = Exchange(request_id="req-1", endpoint="chat", started=0.0)
    assert "x-forwarded-for" not in names(upstream_headers(ex, replica()))


def test_upstream_headers_forward_the_anthropic_headers_only_when_given() -> None:
    ex = Exchange(request_id="req-1", endpoint="messages", started=0.0)
    forward = [("anthropic-version", "2023-06-01"), ("anthropic-beta", "tools-2024")]
    given = upstream_headers(ex, replica(), forward)
    assert ("anthropic-version", "2023-06-01") in given and ("anthropic-beta", "tools-2024") in given
    plain = upstream_headers(ex, replica())
    assert not [name for name in names(plain) if name.startswith("anthropic-")]


@pytest.mark.parametrize(
    ("engine", "client_stream", "upstream_stream", "close"),
    [
        ("llamacpp", True, True, True),
        ("llamacpp", False, True, True),  # a whole answer asked for as a stream, then assembled
        ("llamacpp", False, False, False),
        ("vllm", True, True, False),
        ("vllm", False, False, False),
    ],
)
def test_upstream_headers_close_a_llamacpp_stream_connection(
    engine: str, client_stream: bool, upstream_stream: bool, close: bool
) -> None:
    ex = Exchange(
        request_id="req-1",
        endpoint="chat",
        started=0.0,
        stream=client_stream,
        upstream_stream=upstream_stream,
    )
    headers = upstream_headers(ex, replica(engine))
    assert (("connection", "close") in headers) is close
    assert (("accept", "text/event-stream") in headers) is upstream_stream


@pytest.mark.parametrize("with_body", [True, False])
def test_upstream_headers_name_a_content_type_only_with_a_body(with_body: bool) -> None:
    ex = Exchange(request_id="req-1", endpoint="chat", started=0.0)
    headers = upstream_headers(ex, replica(), with_body=with_body)
    assert (("content-type", "application/json") in headers) is with_body


# --- Attempt.unfit ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "pinned", "unfit"),
    [
        (BY_NAME["chat"], None, []),
        (BY_NAME["infill"], None, ["r0"]),  # fill-in-the-middle is llama.cpp's alone
        (STORED, None, ["r1"]),  # llama-server keeps no stored responses
        (BY_NAME["chat"], "r1", ["r0"]),  # pinned: every replica but that one
        (BY_NAME["chat"], "r0", ["r1"]),
        (STORED, "r1", ["r0", "r1"]),  # pinned to a replica whose engine lacks the endpoint
    ],
)
def test_unfit_names_the_replicas_a_request_must_never_reach(
    endpoint: Endpoint, pinned: str | None, unfit: list[str]
) -> None:
    assert attempt(make_pool(*TWO), endpoint, pinned=pinned).unfit() == unfit


# --- the Dispatcher against a scripted client -------------------------------------------------


@dataclass
class FakeResponse:
    status: int
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b"{}"
    closed: bool = False

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self.body

    async def read(self, limit: int | None = None) -> bytes:
        return self.body if limit is None else self.body[:limit]

    async def close(self) -> None:
        self.closed = True


@dataclass
class Sent:
    url: str
    headers: list[tuple[str, str]]
    body: bytes
    timeouts: Timeouts
    method: str


@dataclass
class ScriptedClient:
    """An UpstreamClient whose answers are scripted per replica URL, in order."""

    script: dict[str, list[FakeResponse | UpstreamError]]
    sent: list[Sent] = field(default_factory=list)

    async def send(
        self, url: str, headers: list[tuple[str, str]], body: bytes, timeouts: Timeouts, method: str = "POST"
    ) -> FakeResponse:
        self.sent.append(Sent(url, headers, body, timeouts, method))
        root = url.split("/v1/", 1)[0]
        outcome = self.script[root].pop(0)
        if isinstance(outcome, UpstreamError):
            raise outcome
        return outcome

    async def get(self, url: str, headers: list[tuple[str, str]], timeout: float) -> tuple[int, bytes]:
        raise AssertionError("the dispatcher never probes")

    async def aclose(self) -> None:
        pass


@dataclass
class Waits:
    seconds: list[float] = field(default_factory=list)

    async def __call__(self, seconds: float) -> None:
        self.seconds.append(seconds)


def dispatcher(client: ScriptedClient, waits: Waits, budget: RetryBudget | None = None) -> Dispatcher:
    return Dispatcher(client, budget or RetryBudget(), 1 << 20, sleep=waits, clock=lambda: 0.0)


@pytest.mark.anyio
async def test_a_refused_connection_is_retried_on_the_second_replica() -> None:
    pool = make_pool(*TWO)
    answer = FakeResponse(200)
    client = ScriptedClient({R0: [ConnectFailed("refused")], R1: [answer]})
    waits, budget = Waits(), RetryBudget()
    one = attempt(pool)
    response, chosen = await dispatcher(client, waits, budget).open(one)
    assert response is answer and chosen.name == "r1"
    assert [s.url for s in client.sent] == [R0 + "/v1/chat/completions", R1 + "/v1/chat/completions"]
    assert client.sent[0].body == client.sent[1].body != b""
    assert client.sent[1].timeouts == Timeouts(connect=5.0, first_byte=None, idle=None)  # not streaming
    assert waits.seconds == [0.0]  # no Retry-After: no wait
    ex = one.ex
    assert ex.retries == ["connect_error"] and ex.upstream_errors == ["connect_error"]
    assert ex.attempts == 2 and ex.path == ["r0:connect_error", "r1:200"]
    assert ex.replica == "r1" and ex.engine == "llamacpp" and ex.failed_replica == "r0"
    assert one.refused == ["r0"] and one.tried == ["r0", "r1"]
    r0, r1 = pool.get("r0"), pool.get("r1")
    assert r0 is not None and r1 is not None
    assert r0.in_flight == 0 and r1.in_flight == 1  # the answer's lease is the caller's to give back
    assert r0.health.connect_fail_streak == 1
    assert budget.retrying == 0  # counted only while retrying


@pytest.mark.anyio
async def test_retry_after_is_waited_when_no_other_replica_is_available() -> None:
    pool = make_pool(("r0", R0, "vllm"))
    busy = FakeResponse(503, {"retry-after": "2"}, b'{"error": "overloaded"}')
    client = ScriptedClient({R0: [busy, FakeResponse(200)]})
    waits = Waits()
    response, chosen = await dispatcher(client, waits).open(attempt(pool))
    assert response.status == 200 and chosen.name == "r0"
    assert waits.seconds == [2.0]
    assert busy.closed  # the 503's connection was given back, not left open


@pytest.mark.anyio
async def test_retry_after_is_not_waited_when_another_replica_is_available() -> None:
    pool = make_pool(*TWO)
    client = ScriptedClient({R0: [FakeResponse(503, {"retry-after": "7"})], R1: [FakeResponse(200)]})
    waits = Waits()
    _, chosen = await dispatcher(client, waits).open(attempt(pool))
    assert chosen.name == "r1" and waits.seconds == [0.0]


@pytest.mark.anyio
async def test_every_replica_answering_503_ends_in_no_upstream_with_retry_after() -> None:
    pool = make_pool(*TWO)
    client = ScriptedClient(
        {R0: [FakeResponse(503, {"retry-after": "3"})], R1: [FakeResponse(503, {"retry-after": "3"})]}
    )
    one = attempt(pool)
    with pytest.raises(NoUpstream) as caught:
        await dispatcher(client, Waits()).open(one)
    assert caught.value.headers == {"retry-after": "3"} and caught.value.code == "upstream_unavailable"
    assert one.ex.attempts == 2 and one.ex.path == ["r0:status_503", "r1:status_503"]
    assert all(r.in_flight == 0 for r in pool.replicas)


@pytest.mark.anyio
async def test_one_configured_attempt_means_no_retry() -> None:
    pool = make_pool(*TWO, attempts=1)
    client = ScriptedClient({R0: [ConnectFailed("refused")], R1: [FakeResponse(200)]})
    waits = Waits()
    with pytest.raises(NoUpstream) as caught:
        await dispatcher(client, waits).open(attempt(pool))
    assert caught.value.headers == {"retry-after": "5"}
    assert len(client.sent) == 1 and waits.seconds == []


@pytest.mark.anyio
async def test_no_retry_once_the_budget_is_spent() -> None:
    pool = make_pool(*TWO)
    client = ScriptedClient({R0: [ConnectFailed("refused")], R1: [FakeResponse(200)]})
    budget = RetryBudget()
    budget.retrying = 10  # the preset's floor (min_concurrent 10), nothing else in flight
    with pytest.raises(NoUpstream):
        await dispatcher(client, Waits(), budget).open(attempt(pool))
    assert len(client.sent) == 1 and budget.retrying == 10


@pytest.mark.anyio
async def test_a_500_is_passed_back_and_never_retried() -> None:
    pool = make_pool(*TWO)
    failed = FakeResponse(500)
    client = ScriptedClient({R0: [failed], R1: [FakeResponse(200)]})
    response, chosen = await dispatcher(client, Waits()).open(attempt(pool))
    assert response is failed and chosen.name == "r0" and len(client.sent) == 1
    assert chosen.health.server_error_streak == 1
