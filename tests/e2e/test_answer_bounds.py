"""What a replica sends is held in bounded memory. An SSE event that never ends
ends the stream with the error event once it passes `max_event_bytes`; a non-streaming answer past
`max_answer_bytes` is a 502, and the gateway stops reading it. Real sockets, a scripted replica.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.fault_behaviours import EndlessEvent, HugeBody, Reply
from tests.support.faults import FaultServer, fault_server
from tests.support.gateway_answers import data_events, error_events
from tests.support.gateway_process import chat_body
from tests.support.harness import Running, eventually, one_replica_table, run_gateway
from tests.support.rawhttp import address_of, http_request

CHAT = "/v1/chat/completions"
CAP = 1024 * 1024


@pytest.fixture
def upstream() -> Iterator[FaultServer]:
    with fault_server(name="A", sndbuf=64 * 1024) as server:
        yield server


@pytest.fixture
def gw(upstream: FaultServer) -> Iterator[Running]:
    with run_gateway(one_replica_table(upstream.url), max_event_bytes=CAP, max_answer_bytes=CAP) as running:
        yield running


def test_an_event_without_its_blank_line_ends_the_stream_at_the_cap(
    gw: Running, upstream: FaultServer
) -> None:
    upstream.push(EndlessEvent(size=64 * CAP))
    response = http_request(address_of(gw.url), "POST", CHAT, chat_body(stream=True), timeout=30)
    assert response.status == 200
    assert len(data_events(response.body)) >= 1  # the complete event before it got through
    errors = error_events(response.body)
    assert errors and errors[-1]["code"] == "upstream_event_too_large"
    assert b"zzzz" not in response.body  # the partial event is dropped, never glued to the error
    request = upstream.chat_requests[-1]
    assert request.conn.eof.wait(5), "the gateway kept reading the endless event"
    assert request.bytes_sent < 16 * CAP  # what it read, plus the kernel's buffers
    entry = eventually(
        lambda: [e for e in gw.log_entries() if e.get("error_code") == "upstream_event_too_large"]
    )
    assert entry


def test_events_under_the_cap_pass_whole(gw: Running, upstream: FaultServer) -> None:
    upstream.push(EndlessEvent(size=0))  # the first event only, then a clean end
    response = http_request(address_of(gw.url), "POST", CHAT, chat_body(stream=True), timeout=30)
    assert response.status == 200 and not error_events(response.body)


def test_a_non_streaming_answer_past_the_cap_is_a_502_and_is_not_read_on(
    gw: Running, upstream: FaultServer
) -> None:
    upstream.push(HugeBody(status=200, size=64 * CAP))
    response = http_request(address_of(gw.url), "POST", CHAT, chat_body(), timeout=30)
    assert response.status == 502
    assert response.json()["error"]["code"] == "upstream_answer_too_large"
    request = upstream.chat_requests[-1]
    assert request.conn.eof.wait(5), "the gateway kept reading the oversized answer"
    assert request.bytes_sent < 16 * CAP


def test_a_large_answer_under_the_cap_is_relayed(gw: Running, upstream: FaultServer) -> None:
    content = "w" * (CAP // 2)
    upstream.push(
        Reply(
            200,
            {
                "id": "x",
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
            },
        )
    )
    response = http_request(address_of(gw.url), "POST", CHAT, chat_body(), timeout=30)
    assert response.status == 200
    assert response.json()["choices"][0]["message"]["content"] == content
