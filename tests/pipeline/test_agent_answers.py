"""What agents hear from the gateway, in each dialect, driven in process: a stream kept alive
while it waits, a prompt past the context said in each agent's own words, a busy fleet said so
that each agent waits and retries, a budget lowered to what the context leaves, and a whole answer
assembled from the stream an engine was asked for."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.answers.events import parse
from tests.support.fake_upstream import LLAMA_SERVER_OVERFLOW, Scripted, chat_answer, sse, whole
from tests.support.proxy_rig import HELLO, Rig, by_host

BUSY_TABLE = """
defaults: {max_tokens: 512, min_max_tokens: 0}
presets:
  one:
    served_model: one-served
    limits: {max_in_flight: 1, queue: 0}
    replicas: [{name: o0, url: "http://one.test:1", engine: vllm}]
routing: {default: one}
"""

MESSAGES = {"model": "dense", "max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]}
RESPONSES = {"model": "dense", "input": "hello"}


def events(body: bytes) -> list[tuple[str | None, Any]]:
    return [(e.name, e.data if e.data is not None else (e.raw or b"").strip()) for e in parse(body)]


def messages_stream(stop_reason: str = "end_turn") -> Scripted:
    def event(name: str, data: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    start = {"type": "message_start", "message": {"id": "msg_replica", "usage": {"input_tokens": 9}}}
    chunks = [
        event("message_start", start),
        event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        event(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
        ),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": stop_reason}, "usage": {"output_tokens": 1}},
        ),
        event("message_stop", {"type": "message_stop"}),
    ]
    return Scripted(chunks=chunks, headers={"content-type": "text/event-stream"})


async def answered_after_keepalive(
    rig: Rig, hold: asyncio.Event, body: dict[str, Any], path: str, marker: bytes, count: int = 1
) -> tuple[Any, Any]:
    """Send a streaming request, let the replica answer only once the client has `count` of the
    gateway's keep-alive `marker` bytes, and return what the client got and the record."""
    task = asyncio.ensure_future(rig.call({**body, "stream": True}, path=path))
    while b"".join(m.get("body", b"") for m in rig.sent_so_far()).count(marker) < count:
        await asyncio.sleep(0.01)
    hold.set()
    return await task


# --- keep-alive ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_waiting_messages_stream_opens_with_message_start_and_pings_then_gets_the_answer() -> None:
    hold = asyncio.Event()
    answer = messages_stream()
    answer.hold = hold
    rig = Rig(by_host(dense=answer), keepalive_after=0.01, keepalive_every=0.01)
    sent, ex = await answered_after_keepalive(rig, hold, MESSAGES, "/v1/messages", b"event: ping")
    seen = events(sent.body)
    names = [name for name, _ in seen if name is not None]
    assert names[0] == "message_start" and names.count("message_start") == 1
    first = seen[0][1]
    assert first["message"]["usage"]["input_tokens"] == ex.estimated_tokens  # the prompt, as counted
    assert first["message"]["model"] == "dense"  # the client's own name for the model
    assert "ping" in names and names.index("ping") < names.index("content_block_start")
    assert names[-1] == "message_stop" and sent.status == 200
    assert (ex.outcome, ex.answer.prompt_tokens) == ("completed", 9)  # the replica's own figures


@pytest.mark.anyio
async def test_a_waiting_responses_stream_opens_with_created_and_keeps_alive_with_events() -> None:
    hold = asyncio.Event()
    created = {"type": "response.created", "response": {"id": "resp_replica", "status": "in_progress"}}
    delta = {"type": "response.output_text.delta", "delta": "hi"}
    done = {
        "type": "response.completed",
        "response": {"id": "resp_replica", "status": "completed", "output": []},
    }
    answer = Scripted(
        chunks=[
            b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n",
            b"event: response.output_text.delta\ndata: " + orjson.dumps(delta) + b"\n\n",
            b"event: response.completed\ndata: " + orjson.dumps(done) + b"\n\n",
        ],
        headers={"content-type": "text/event-stream"},
        hold=hold,
    )
    rig = Rig(by_host(dense=answer), keepalive_after=0.01, keepalive_every=0.01)
    sent, _ = await answered_after_keepalive(
        rig, hold, RESPONSES, "/v1/responses", b"response.in_progress", 3
    )
    kinds = [data.get("type") for _, data in events(sent.body) if isinstance(data, dict)]
    assert kinds[0] == "response.created" and kinds.count("response.created") == 1
    assert kinds.count("response.in_progress") >= 3  # events, which Codex's idle timer counts
    assert kinds[-2:] == ["response.output_text.delta", "response.completed"]


@pytest.mark.anyio
async def test_a_replica_that_breaks_off_after_the_gateway_opened_a_messages_stream_ends_it_with_an_error_event() -> (
    None
):
    hold = asyncio.Event()
    answer = messages_stream()
    answer.hold, answer.fail_at = hold, 0  # the replica waits, then goes away before its first event
    rig = Rig(by_host(dense=answer), keepalive_after=0.01, keepalive_every=0.01)
    sent, ex = await answered_after_keepalive(rig, hold, MESSAGES, "/v1/messages", b"event: ping")
    seen = events(sent.body)
    names = [name for name, _ in seen if name is not None]
    assert sent.status == 200 and names[0] == "message_start"
    assert names[-1] == "error" and "message_stop" not in names
    error = seen[-1][1]
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert ex.outcome == "upstream_error"


@pytest.mark.anyio
async def test_a_replica_that_breaks_off_after_the_gateway_opened_a_responses_stream_ends_it_with_an_error_event() -> (
    None
):
    hold = asyncio.Event()
    answer = Scripted(
        chunks=[b"event: response.created\ndata: {}\n\n"],
        headers={"content-type": "text/event-stream"},
        hold=hold,
        fail_at=0,
    )
    rig = Rig(by_host(dense=answer), keepalive_after=0.01, keepalive_every=0.01)
    sent, ex = await answered_after_keepalive(rig, hold, RESPONSES, "/v1/responses", b"response.in_progress")
    datas = [data for _, data in events(sent.body) if isinstance(data, dict)]
    kinds = [data.get("type") for data in datas]
    assert sent.status == 200 and kinds[0] == "response.created"
    # Not a busy fleet or an overflow (those end in `response.failed`): the stream's error event.
    assert kinds[-1] == "error" and "response.completed" not in kinds
    assert datas[-1]["code"] == "upstream_disconnected"
    assert ex.outcome == "upstream_error"


@pytest.mark.anyio
async def test_a_chat_stream_that_answers_at_once_is_not_touched_by_the_keep_alive() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}
    rig = Rig(by_host(dense=sse(chunk)), keepalive_after=5, keepalive_every=5)
    sent, _ = await rig.call({**HELLO, "stream": True})
    assert sent.body == b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"


# --- a prompt past the context -------------------------------------------------------------------


def long_prompt(words: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "word " * words}]


@pytest.mark.anyio
async def test_a_prompt_past_the_context_is_said_in_each_agents_words() -> None:
    rig = Rig(by_host(dense=whole(chat_answer())))
    rig.fleet.pools["dense"].replicas[0].context = 100
    rig.fleet.pools["moe"].replicas[0].context = 100  # the fallback cannot take it either
    sent, _ = await rig.call({**MESSAGES, "messages": long_prompt(400)}, path="/v1/messages")
    assert sent.status == 400 and sent.headers["x-should-retry"] == "false"
    assert sent.json()["error"] == {
        "type": "invalid_request_error",
        "message": "prompt is too long: 501 tokens > 100 maximum",
    }
    sent, _ = await rig.call({**HELLO, "messages": long_prompt(400)})
    error = sent.json()["error"]
    assert sent.status == 400 and error["code"] == "context_length_exceeded"
    assert error["message"].startswith(
        "This model's maximum context length is 100 tokens. However, your messages resulted in 501 tokens."
    )
    sent, _ = await rig.call({**RESPONSES, "input": "word " * 400}, path="/v1/responses")
    assert sent.status == 400 and sent.json()["error"]["code"] == "context_length_exceeded"
    sent, _ = await rig.call({**RESPONSES, "input": "word " * 400, "stream": True}, path="/v1/responses")
    kinds = [(name, data) for name, data in events(sent.body)]
    assert sent.status == 200 and [n for n, _ in kinds] == ["response.created", "response.failed"]
    failed = kinds[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "context_length_exceeded"
    assert rig.upstream.sent == []  # refused before any GPU time


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("refusal", "counted"),
    [
        (
            {
                "error": {
                    "message": "This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, which exceeds this limit even without any output tokens.",
                    "type": "BadRequestError",
                    "code": 400,
                }
            },
            5000,
        ),
        (
            LLAMA_SERVER_OVERFLOW,
            5000,
        ),
    ],
    ids=["vllm", "llama-server"],
)
async def test_an_engines_own_overflow_is_translated_with_its_own_count(
    refusal: dict[str, Any], counted: int
) -> None:
    rig = Rig(by_host(lone=whole(refusal, status=400)))
    sent, _ = await rig.call({**MESSAGES, "model": "lone"}, path="/v1/messages")
    assert sent.status == 400
    assert sent.json()["error"]["message"] == f"prompt is too long: {counted} tokens > 4096 maximum"


# --- budgets -------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_budget_is_lowered_to_what_the_context_leaves_after_the_prompt() -> None:
    rig = Rig(by_host(lone=whole(chat_answer())))
    rig.fleet.pools["lone"].replicas[0].context = 2000
    sent, ex = await rig.call({**HELLO, "model": "lone", "max_tokens": 64000, "messages": long_prompt(200)})
    assert sent.status == 200
    assert rig.upstream.sent[0].json()["max_tokens"] == 2000 - ex.estimated_tokens
    assert f"max_tokens=64000->{2000 - ex.estimated_tokens}" in sent.headers["x-gateway-rewrites"]


@pytest.mark.anyio
async def test_a_budget_the_client_chose_that_cannot_fit_is_said_in_anthropics_words() -> None:
    rig = Rig(by_host(lone=whole(chat_answer())))
    rig.fleet.pools["lone"].replicas[0].context = 1000
    body = {**MESSAGES, "model": "lone", "max_tokens": 4000, "messages": long_prompt(700)}
    sent, ex = await rig.call(body, path="/v1/messages")
    assert sent.status == 400
    assert sent.json()["error"]["message"] == (
        f"input length and `max_tokens` exceed context limit: {ex.estimated_tokens} + 4000 > 1000, "
        "decrease input length or `max_tokens` and try again"
    )


def messages_answer(stop_reason: str) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "lone-served",
        "content": [{"type": "text", "text": "partial"}],
        "stop_reason": stop_reason,
        "usage": {"input_tokens": 300, "output_tokens": 1700},
    }


@pytest.mark.anyio
async def test_a_stop_on_a_budget_lowered_to_the_context_is_a_full_context_for_claude_code() -> None:
    rig = Rig(by_host(lone=whole(messages_answer("max_tokens"))))
    rig.fleet.pools["lone"].replicas[0].context = 2000
    body = {**MESSAGES, "model": "lone", "max_tokens": 64000, "messages": long_prompt(200)}
    sent, _ = await rig.call(body, path="/v1/messages")
    assert sent.status == 200 and "max_tokens=64000->" in sent.headers["x-gateway-rewrites"]
    assert sent.json()["stop_reason"] == "model_context_window_exceeded"


@pytest.mark.anyio
async def test_a_streamed_stop_on_a_budget_lowered_to_the_context_is_a_full_context() -> None:
    rig = Rig(by_host(lone=messages_stream("max_tokens")))
    rig.fleet.pools["lone"].replicas[0].context = 2000
    body = {**MESSAGES, "model": "lone", "max_tokens": 64000, "stream": True, "messages": long_prompt(200)}
    sent, _ = await rig.call(body, path="/v1/messages")
    deltas = [data for name, data in events(sent.body) if name == "message_delta"]
    assert [d["delta"]["stop_reason"] for d in deltas] == ["model_context_window_exceeded"]


@pytest.mark.anyio
async def test_a_stop_on_the_clients_own_budget_stays_max_tokens() -> None:
    # The context leaves more than the client asked for: its budget, not the context, ran out.
    rig = Rig(by_host(lone=whole(messages_answer("max_tokens")), dense=messages_stream("max_tokens")))
    rig.fleet.pools["lone"].replicas[0].context = 200_000
    body = {**MESSAGES, "model": "lone", "max_tokens": 4000, "messages": long_prompt(200)}
    sent, _ = await rig.call(body, path="/v1/messages")
    assert "max_tokens=" not in sent.headers.get("x-gateway-rewrites", "")
    assert sent.json()["stop_reason"] == "max_tokens"
    streamed, _ = await rig.call({**MESSAGES, "max_tokens": 4000, "stream": True}, path="/v1/messages")
    deltas = [data for name, data in events(streamed.body) if name == "message_delta"]
    assert [d["delta"]["stop_reason"] for d in deltas] == ["max_tokens"]


# --- a busy fleet --------------------------------------------------------------------------------


async def busy_rig() -> tuple[Rig, asyncio.Event, asyncio.Future[Any]]:
    hold = asyncio.Event()
    rig = Rig(lambda url, body: Scripted(chunks=[orjson.dumps(chat_answer())], hold=hold), table=BUSY_TABLE)
    holder = asyncio.ensure_future(rig.call({**HELLO, "model": "one"}))
    while not rig.upstream.answers:
        await asyncio.sleep(0)
    return rig, hold, holder


@pytest.mark.anyio
async def test_a_full_queue_is_a_429_claude_code_retries_with_its_hint() -> None:
    rig, hold, holder = await busy_rig()
    sent, ex = await rig.call({**MESSAGES, "model": "one"}, path="/v1/messages")
    hold.set()
    await holder
    assert sent.status == 429 and sent.json()["error"]["type"] == "rate_limit_error"
    assert sent.headers["retry-after"] == "1" and sent.headers["x-should-retry"] == "true"
    assert ex.error_code == "queue_full"


@pytest.mark.anyio
async def test_a_full_queue_ends_a_codex_stream_with_a_rate_limit_failure_naming_the_wait() -> None:
    rig, hold, holder = await busy_rig()
    sent, _ = await rig.call({**RESPONSES, "model": "one", "stream": True}, path="/v1/responses")
    plain, _ = await rig.call({**RESPONSES, "model": "one"}, path="/v1/responses")
    hold.set()
    await holder
    named = events(sent.body)
    assert sent.status == 200 and [n for n, _ in named] == ["response.created", "response.failed"]
    error = named[-1][1]["response"]["error"]
    assert error["code"] == "rate_limit_exceeded" and error["message"].endswith("Please try again in 1s.")
    assert plain.status == 429 and plain.json()["error"]["code"] == "rate_limit_exceeded"
    assert plain.json()["error"]["message"].endswith("Please try again in 1s.")


# --- whole answers from streams ------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_whole_answer_from_an_engine_asked_for_a_stream_is_assembled_in_the_dialects_shape() -> None:
    chunks = [
        {
            "id": "c1",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        },
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "hel"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}},
    ]
    rig = Rig(by_host(moe=sse(*chunks)))
    sent, ex = await rig.call({**HELLO, "model": "moe"})
    assert rig.upstream.sent[0].json()["stream"] is True  # llama-server keeps a whole answer going
    answer = sent.json()
    assert answer["object"] == "chat.completion" and answer["id"] == "c1"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["total_tokens"] == 6
    assert (ex.upstream_stream, ex.answer.completion_tokens) == (True, 2)
    sent, _ = await rig.call({**MESSAGES, "model": "moe"}, path="/v1/messages")
    rig2 = Rig(by_host(moe=messages_stream()))
    sent, _ = await rig2.call({**MESSAGES, "model": "moe"}, path="/v1/messages")
    message = sent.json()
    assert message["type"] == "message" and message["content"] == [{"type": "text", "text": "hi"}]
    assert message["stop_reason"] == "end_turn" and message["usage"] == {
        "input_tokens": 9,
        "output_tokens": 1,
    }
