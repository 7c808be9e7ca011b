"""The request path driven in process: `Proxy.handle` with a scripted upstream client, no sockets.

Each test scripts what the replicas answer and checks what the client got and what the record
says: relaying, a replica's own errors, fallback between presets, the deadline, a client that
leaves (with and without detaching the replica's work) and a server that stops.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.upstream import ConnectFailed
from tests.support.fake_upstream import Scripted, chat_answer, sse, whole
from tests.support.proxy_rig import HELLO, Rig, by_host


@pytest.mark.anyio
async def test_a_whole_answer_is_relayed_with_the_gateways_headers_and_recorded() -> None:
    rig = Rig(by_host(dense=whole(chat_answer("hi there", prompt=7, completion=2))))
    sent, ex = await rig.call(HELLO)
    assert sent.status == 200 and sent.json()["choices"][0]["message"]["content"] == "hi there"
    assert sent.headers["x-gateway-preset"] == "dense" and sent.headers["x-gateway-replica"] == "d0"
    assert (ex.status, ex.outcome, ex.attempts, ex.replica) == (200, "completed", 1, "d0")
    assert (ex.answer.prompt_tokens, ex.answer.completion_tokens) == (7, 2)
    forwarded = rig.upstream.sent[0].json()
    assert forwarded["model"] == "dense-served" and forwarded["max_tokens"] == 512
    assert rig.upstream.answers[0].closed


@pytest.mark.anyio
async def test_a_replicas_4xx_keeps_its_status_and_message_in_the_clients_dialect() -> None:
    refusal = whole({"error": {"message": "bad grammar at http://10.0.0.7:8000", "type": "x"}}, status=422)
    rig = Rig(by_host(dense=refusal))
    body = {"model": "dense", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    sent, ex = await rig.call(body, path="/v1/messages")
    assert sent.status == 422
    payload = sent.json()
    assert payload["type"] == "error" and "[address]" in payload["error"]["message"]
    assert "10.0.0.7" not in payload["error"]["message"]
    assert (ex.status, ex.error_code) == (422, "422")


@pytest.mark.anyio
async def test_a_replicas_500_becomes_the_gateways_own_500_and_is_not_retried() -> None:
    rig = Rig(by_host(dense=whole({"error": {"message": "template failed"}}, status=500)))
    sent, ex = await rig.call(HELLO)
    assert sent.status == 500 and "template failed" not in sent.body.decode()
    assert (ex.outcome, ex.attempts) == ("upstream_error", 1)


@pytest.mark.anyio
async def test_a_preset_whose_replicas_cannot_be_reached_falls_back_and_says_so() -> None:
    rig = Rig(by_host(dense=ConnectFailed("refused"), moe=whole(chat_answer("from moe"))))
    sent, ex = await rig.call(HELLO)
    assert sent.status == 200 and sent.json()["choices"][0]["message"]["content"] == "from moe"
    assert sent.headers["x-gateway-fallback"] == "dense->moe (down)"
    assert (ex.preset, ex.fallback_from, ex.fallback_reason) == ("moe", "dense", "down")
    assert rig.upstream.sent[-1].json()["model"] == "moe-served"


@pytest.mark.anyio
async def test_an_engines_context_refusal_falls_back_with_the_request_rewritten_afresh() -> None:
    too_long = whole(
        {"error": {"message": "This model's maximum context length is 4096 tokens.", "type": "x"}}, status=400
    )
    rig = Rig(by_host(dense=too_long, moe=whole(chat_answer())))
    sent, ex = await rig.call(HELLO)
    assert sent.status == 200 and ex.fallback_reason == "context"
    first, second = (s.json() for s in rig.upstream.sent)
    assert (first["model"], second["model"]) == ("dense-served", "moe-served")
    assert second["messages"] == HELLO["messages"]


@pytest.mark.anyio
async def test_no_fallback_when_the_client_forbids_it() -> None:
    rig = Rig(by_host(dense=ConnectFailed("refused"), moe=whole(chat_answer())))
    sent, ex = await rig.call(HELLO, headers=[("x-gateway-fallback", "none")])
    assert sent.status == 503 and ex.preset == "dense"
    assert all("moe" not in s.url for s in rig.upstream.sent)


@pytest.mark.anyio
async def test_a_prompt_past_every_context_is_refused_before_any_replica_is_asked() -> None:
    rig = Rig(by_host(lone=whole(chat_answer())))
    rig.fleet.pools["lone"].replicas[0].context = 100
    body = {"model": "lone", "messages": [{"role": "user", "content": "word " * 400}]}
    sent, ex = await rig.call(body)
    assert sent.status == 400 and sent.json()["error"]["code"] == "context_length_exceeded"
    assert rig.upstream.sent == [] and ex.attempts == 0


@pytest.mark.anyio
async def test_the_deadline_ends_a_request_whose_replica_never_answers() -> None:
    rig = Rig(by_host(lone=Scripted(chunks=[b"{}"], hold=asyncio.Event())))
    sent, ex = await rig.call({**HELLO, "model": "lone"})
    assert sent.status == 504 and sent.json()["error"]["code"] == "deadline_exceeded"
    assert (ex.outcome, ex.error_code) == ("upstream_error", "deadline_exceeded")
    assert rig.upstream.answers[0].closed


@pytest.mark.anyio
async def test_a_stream_is_relayed_and_a_replica_that_breaks_off_ends_it_with_one_error_event() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}
    broken = sse(chunk, chunk, chunk)
    broken.fail_at = 2
    rig = Rig(by_host(dense=broken))
    sent, ex = await rig.call({**HELLO, "stream": True})
    events = [e for e in sent.body.split(b"\n\n") if e]
    assert sent.status == 200 and len(events) == 3
    assert b'"upstream_disconnected"' in events[-1] and b"[DONE]" not in sent.body
    assert (ex.outcome, ex.error_code, ex.answer.events) == ("upstream_error", "upstream_disconnected", 2)


@pytest.mark.anyio
async def test_a_client_that_leaves_while_waiting_is_recorded_and_the_replica_request_closed() -> None:
    leave, hold = asyncio.Event(), asyncio.Event()
    rig = Rig(by_host(dense=Scripted(chunks=[b"{}"], hold=hold)))
    task = asyncio.ensure_future(rig.call(HELLO, leave=leave))
    while not rig.upstream.answers:
        await asyncio.sleep(0)
    leave.set()
    sent, ex = await task
    assert sent.messages == []
    assert (ex.outcome, ex.disconnect_phase, ex.status_class) == ("client_disconnected", "waiting", "499")
    assert rig.upstream.answers[0].closed and not rig.upstream.answers[0].read_to_end


@pytest.mark.anyio
async def test_a_replica_that_mishandles_aborts_finishes_its_answer_unread_when_the_client_leaves() -> None:
    leave, hold = asyncio.Event(), asyncio.Event()
    rig = Rig(by_host(patient=Scripted(chunks=[b"{", b"}"], hold=hold, hold_at=1)))
    task = asyncio.ensure_future(rig.call({**HELLO, "model": "patient"}, leave=leave))
    while not rig.upstream.answers:
        await asyncio.sleep(0)
    leave.set()
    _, ex = await task
    assert ex.outcome == "client_disconnected"
    answer = rig.upstream.answers[0]
    assert not answer.closed and rig.fleet.pools["patient"].replicas[0].in_flight == 1  # still draining
    hold.set()
    for _ in range(100):
        if answer.closed:
            break
        await asyncio.sleep(0)
    assert answer.read_to_end and answer.closed
    assert rig.fleet.pools["patient"].replicas[0].in_flight == 0


@pytest.mark.anyio
async def test_a_server_that_stops_says_so_to_a_waiting_client() -> None:
    rig = Rig(by_host(dense=Scripted(chunks=[b"{}"], hold=asyncio.Event())))
    task = asyncio.ensure_future(rig.call(HELLO))
    while not rig.upstream.answers:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ex = rig.records[-1]
    assert (ex.status, ex.error_code) == (503, "shutdown")


@pytest.mark.anyio
async def test_request_ids_share_one_random_prefix_per_process_and_count_up() -> None:
    rig = Rig(by_host(dense=whole(chat_answer("a"))))
    (sent, first), (_, second) = [await rig.call(HELLO) for _ in range(2)]
    assert sent.status == 200 and (first.outcome, second.outcome) == ("completed", "completed")
    prefix, number = first.request_id.rsplit("-", 1)
    assert len(prefix) == 12 and second.request_id == f"{prefix}-{int(number) + 1}"
    _, third = await Rig(by_host(dense=whole(chat_answer("c")))).call(HELLO)
    assert not third.request_id.startswith(prefix)
