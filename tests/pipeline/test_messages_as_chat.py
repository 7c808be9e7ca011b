"""A Claude Code session placed on llama-server (`policy: session`) goes to the engine's chat
endpoint, pinned to its slot, and the client hears Messages: streamed, whole, with tool calls, with
the prompt's cache figures, and with an overflow in its own words. Driven in process."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.answers.events import parse
from tests.support.fake_upstream import LLAMA_SERVER_OVERFLOW, Scripted, sse, whole
from tests.support.proxy_rig import Rig

TABLE = """
defaults: {max_tokens: 512, min_max_tokens: 0}
presets:
  agents:
    served_model: agents-served
    aliases: ["claude-*"]
    policy: session
    replicas: [{name: a0, url: "http://agents.test:1", engine: llamacpp}]
routing: {default: agents}
"""
SESSION = [("x-claude-code-session-id", "3f1c6f0e-8a52-4d57-9a55-0c1c6cd0f6a1")]
TURN = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 64,
    "system": [{"type": "text", "text": "You are Claude Code."}],
    "tools": [{"name": "Read", "description": "read a file", "input_schema": {"type": "object"}}],
    "messages": [{"role": "user", "content": "read a.py"}],
}
TIMINGS = {"cache_n": 90, "prompt_n": 10, "predicted_n": 1}
USAGE = {"prompt_tokens": 100, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 90}}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-9", "object": "chat.completion.chunk", "choices": choices, **extra}


def text_answer() -> Scripted:
    return sse(
        chunk({"role": "assistant", "content": None}),
        chunk({"content": "Sure"}, timings=TIMINGS),
        chunk({}, "stop"),
        chunk(usage=USAGE),
    )


def tool_answer() -> Scripted:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "Read", "arguments": ""}}
    return sse(
        chunk({"tool_calls": [call]}, timings=TIMINGS),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "a.py"}'}}]}),
        chunk({}, "tool_calls"),
        chunk(usage=USAGE),
    )


def rig(answer: Scripted, **settings: Any) -> Rig:
    made = Rig(lambda url, body: answer, table=TABLE, **settings)
    made.fleet.pools["agents"].replicas[0].cache.resize(2)  # llama-server's slots, as /props said
    return made


def named(body: bytes) -> list[tuple[str | None, Any]]:
    return [(e.name, e.data) for e in parse(body) if e.data is not None]


@pytest.mark.anyio
async def test_a_streamed_turn_goes_to_the_chat_endpoint_pinned_and_comes_back_as_messages_events() -> None:
    r = rig(text_answer())
    sent, ex = await r.call({**TURN, "stream": True}, path="/v1/messages", headers=SESSION)
    upstream = r.upstream.sent[0]
    assert upstream.url == "http://agents.test:1/v1/chat/completions"
    body = upstream.json()
    assert body["id_slot"] == 0 and body["timings_per_token"] is True
    assert body["messages"][0] == {"role": "system", "content": "You are Claude Code."}
    assert body["tools"][0]["function"]["name"] == "Read"
    seen = named(sent.body)
    assert [name for name, _ in seen] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert seen[0][1]["message"]["usage"]["cache_read_input_tokens"] == 90
    assert seen[2][1]["delta"] == {"type": "text_delta", "text": "Sure"}
    assert (ex.answer.prompt_tokens, ex.answer.cached_tokens, ex.answer.completion_tokens) == (100, 90, 2)
    assert ex.upstream_as_chat and ex.outcome == "completed"


@pytest.mark.anyio
async def test_a_whole_turn_with_a_tool_call_is_assembled_as_a_messages_answer() -> None:
    r = rig(tool_answer())
    sent, ex = await r.call(TURN, path="/v1/messages", headers=SESSION)
    assert r.upstream.sent[0].json()["stream"] is True  # asked for as a stream, assembled here
    message = sent.json()
    assert sent.status == 200 and message["type"] == "message" and message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "Read", "input": {"path": "a.py"}}
    ]
    assert message["usage"]["cache_read_input_tokens"] == 90 and message["usage"]["input_tokens"] == 10
    assert ex.upstream_as_chat


@pytest.mark.anyio
async def test_the_engines_overflow_on_the_chat_endpoint_is_said_in_claude_codes_words() -> None:
    sent, _ = await rig(whole(LLAMA_SERVER_OVERFLOW, status=400)).call(
        TURN, path="/v1/messages", headers=SESSION
    )
    assert sent.status == 400
    assert sent.json()["error"] == {
        "type": "invalid_request_error",
        "message": "prompt is too long: 5000 tokens > 4096 maximum",
    }


@pytest.mark.anyio
async def test_a_waiting_stream_keeps_its_single_message_start_and_gets_the_cache_figures_at_the_end() -> (
    None
):
    hold = asyncio.Event()
    answer = text_answer()
    answer.hold = hold
    r = rig(answer, keepalive_after=0.01, keepalive_every=0.01)
    task = asyncio.ensure_future(r.call({**TURN, "stream": True}, path="/v1/messages", headers=SESSION))
    for _ in range(6000):  # bounded: the keep-alive comes after 0.01 s
        if b"event: ping" in b"".join(m.get("body", b"") for m in r.sent_so_far()):
            break
        await asyncio.sleep(0.01)
    hold.set()
    sent, ex = await task
    seen = named(sent.body)
    names = [name for name, _ in seen]
    assert names.count("message_start") == 1 and names[-1] == "message_stop"
    assert names.index("ping") < names.index("content_block_start")  # the gateway's own opening came first
    delta = next(data for name, data in seen if name == "message_delta")
    assert (
        delta["usage"]["cache_read_input_tokens"] == 90
    )  # the engine's figure, though its opening was dropped
    assert ex.answer.cached_tokens == 90


@pytest.mark.anyio
async def test_a_turn_without_a_session_policy_goes_to_the_messages_endpoint_as_before() -> None:
    plain = TABLE.replace("    policy: session\n", "")
    messages_stream = Scripted(
        chunks=[b'event: message_stop\ndata: {"type":"message_stop"}\n\n'],
        headers={"content-type": "text/event-stream"},
    )
    r = Rig(lambda url, body: messages_stream, table=plain)
    _, ex = await r.call({**TURN, "stream": True}, path="/v1/messages", headers=SESSION)
    assert r.upstream.sent[0].url == "http://agents.test:1/v1/messages"
    assert orjson.loads(r.upstream.sent[0].body)["messages"] == TURN["messages"]
    assert not ex.upstream_as_chat
