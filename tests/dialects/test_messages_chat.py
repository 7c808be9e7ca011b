"""A Messages request sent as a chat completion (what llama-server's own conversion builds) and the
chat stream read back as the Messages events the client's SDK assembles."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.answers.assemble import assembler_for
from gateway.answers.events import parse
from gateway.dialects.messages_chat import ChatEventTooLarge, ChatStreamAsMessages, messages_to_chat

TOOLS = [{"name": "read", "description": "read a file", "input_schema": {"type": "object"}}]


def test_system_blocks_become_one_system_message_and_tools_become_functions() -> None:
    chat = messages_to_chat(
        {
            "model": "m",
            "system": [{"type": "text", "text": "You are terse. "}, {"type": "text", "text": "Really."}],
            "messages": [{"role": "user", "content": "hi"}],
            "tools": TOOLS,
            "max_tokens": 64,
            "metadata": {"user_id": "u"},
            "context_management": {"edits": []},
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "You are terse. Really."},
        {"role": "user", "content": "hi"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "read", "description": "read a file", "parameters": {"type": "object"}},
        }
    ]
    assert chat["model"] == "m" and chat["max_tokens"] == 64
    assert "metadata" not in chat and "context_management" not in chat  # dropped, as the engine drops them
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["timings_per_token"] is True


def test_an_assistant_turn_keeps_its_text_thinking_and_tool_calls_in_one_message() -> None:
    chat = messages_to_chat(
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "look first", "signature": "s"},
                        {"type": "text", "text": "reading"},
                        {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.py"}},
                    ],
                }
            ]
        }
    )
    assert chat["messages"] == [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "reading"}],
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"path":"a.py"}'},
                }
            ],
            "reasoning_content": "look first",
        }
    ]


def test_tool_results_follow_their_turns_text_as_tool_messages() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
    chat = messages_to_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_3",
                            "content": [{"type": "text", "text": "shot"}, image],
                        },
                        {"type": "tool_result", "tool_use_id": "toolu_4", "is_error": True},
                        {"type": "text", "text": "go on"},
                    ],
                }
            ]
        }
    )
    assert chat["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "go on"}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "print(1)"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "ab"},
        {
            "role": "tool",
            "tool_call_id": "toolu_3",
            "content": [
                {"type": "text", "text": "shot"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_4", "content": ""},
    ]


def test_images_thinking_stops_and_tool_choice_are_carried_over() -> None:
    chat = messages_to_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "https://example.test/a.png"}},
                        {"type": "text", "text": "what is this"},
                    ],
                }
            ],
            "stop_sequences": ["</done>"],
            "thinking": {"type": "enabled", "budget_tokens": 512},
            "tool_choice": {"type": "tool", "name": "read", "disable_parallel_tool_use": True},
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert chat["messages"][0]["content"][0] == {
        "type": "image_url",
        "image_url": {"url": "https://example.test/a.png"},
    }
    assert chat["stop"] == ["</done>"] and chat["thinking_budget_tokens"] == 512
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["max_tokens"] == 4096  # the engine's own default for a Messages body without one
    assert messages_to_chat({"messages": [], "tool_choice": {"type": "none"}})["tool_choice"] == "none"
    assert "tool_choice" not in messages_to_chat({"messages": [], "tool_choice": "auto"})


def test_an_assistant_turn_without_content_is_left_out() -> None:
    chat = messages_to_chat({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]})
    assert chat["messages"] == [{"role": "user", "content": "a"}]


# --- the stream ----------------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    payload: dict[str, Any] = {"id": "chatcmpl-1", "model": "m", "object": "chat.completion.chunk", **extra}
    payload["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return b"data: " + orjson.dumps(payload) + b"\n\n"


TIMINGS = {"cache_n": 900, "prompt_n": 100, "predicted_n": 1}
USAGE = {"prompt_tokens": 1000, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 900}}


def text_stream() -> bytes:
    return b"".join(
        [
            chunk({"role": "assistant", "content": None}),
            chunk({"content": "Hel"}, timings=TIMINGS),
            chunk({"content": "lo"}, timings=TIMINGS),
            chunk({}, "stop"),
            chunk(usage=USAGE, timings=TIMINGS),
            b"data: [DONE]\n\n",
        ]
    )


def transcode(stream: bytes, piece: int | None = None) -> list[dict[str, Any]]:
    coder = ChatStreamAsMessages()
    pieces = [stream] if piece is None else [stream[i : i + piece] for i in range(0, len(stream), piece)]
    out = b"".join(coder.feed(p) for p in pieces) + coder.end()
    events = parse(out)
    for event in events:
        assert event.name == event.kind  # every event is named after its type, as the SDKs read them
    return [event.data for event in events if event.data is not None]


def test_a_text_answer_becomes_the_messages_events_with_the_prompts_cache_figures() -> None:
    events = transcode(text_stream())
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["id"] == "chatcmpl-1" and start["role"] == "assistant" and start["content"] == []
    # From the first token's timings: what the engine found cached, and what it evaluated.
    assert start["usage"] == {"cache_read_input_tokens": 900, "input_tokens": 100, "output_tokens": 0}
    assert events[2]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert events[5]["delta"]["stop_reason"] == "end_turn"
    assert events[5]["usage"] == {"input_tokens": 100, "cache_read_input_tokens": 900, "output_tokens": 3}


def test_the_events_are_the_same_however_the_stream_is_cut_into_pieces() -> None:
    whole = transcode(text_stream())
    for piece in (1, 7, 64):
        assert transcode(text_stream(), piece) == whole


def tool_call_stream() -> bytes:
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "read", "arguments": ""}}
    second = {
        "index": 1,
        "id": "call_b",
        "type": "function",
        "function": {"name": "grep", "arguments": '{"q":'},
    }
    return b"".join(
        [
            chunk({"role": "assistant", "content": None}),
            chunk({"reasoning_content": "need the file"}, timings=TIMINGS),
            chunk({"content": "Reading."}),
            chunk({"tool_calls": [first]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"path":'}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"a.py"}'}}]}),
            chunk({"tool_calls": [second]}),
            chunk({"tool_calls": [{"index": 1, "function": {"arguments": '"x"}'}}]}),
            chunk({}, "tool_calls"),
            chunk(usage=USAGE),
            b"data: [DONE]\n\n",
        ]
    )


def test_thinking_text_and_tool_calls_become_blocks_the_messages_assembler_puts_together() -> None:
    events = transcode(tool_call_stream())
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use", "tool_use"]
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2, 3]
    assert starts[2] == {"type": "tool_use", "id": "call_a", "name": "read", "input": {}}
    assembler = assembler_for("messages")
    assert assembler is not None
    for event in parse(
        b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)
    ):
        assembler.feed(event)
    message = assembler.result()
    assert message["stop_reason"] == "tool_use"
    assert message["content"][0]["thinking"] == "need the file"
    assert message["content"][1] == {"type": "text", "text": "Reading."}
    assert message["content"][2]["input"] == {"path": "a.py"}
    assert message["content"][3]["input"] == {"q": "x"}


def test_a_budget_cut_is_max_tokens_and_an_answer_without_usage_counts_from_its_timings() -> None:
    stream = chunk({"content": "a"}, timings=TIMINGS) + chunk(
        {}, "length", timings={**TIMINGS, "predicted_n": 5}
    )
    events = transcode(stream + b"data: [DONE]\n\n")
    delta = events[-2]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"] == {"input_tokens": 100, "cache_read_input_tokens": 900, "output_tokens": 5}


def test_an_error_in_the_stream_is_the_messages_error_event_and_nothing_follows_it() -> None:
    error = b'data: {"error": {"code": 500, "message": "slot failed", "type": "server_error"}}\n\n'
    events = transcode(chunk({"content": "a"}, timings=TIMINGS) + error + chunk({}, "stop"))
    assert events[-1] == {"type": "error", "error": {"type": "server_error", "message": "slot failed"}}
    assert "message_stop" not in [e["type"] for e in events]


def test_a_stream_that_ends_without_a_finish_reason_gets_no_message_stop() -> None:
    events = transcode(chunk({"content": "a"}, timings=TIMINGS))
    assert events[-1]["type"] == "content_block_delta"


def test_an_answer_with_no_token_still_opens_and_closes_the_message() -> None:
    events = transcode(chunk({}, "stop") + chunk(usage=USAGE) + b"data: [DONE]\n\n")
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["cache_read_input_tokens"] == 900


def test_an_event_that_never_ends_is_refused_past_the_limit() -> None:
    coder = ChatStreamAsMessages(max_event=1024)
    coder.feed(b"data: {" + b"x" * 1000)
    with pytest.raises(ChatEventTooLarge):
        coder.feed(b"x" * 100)
