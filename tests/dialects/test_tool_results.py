"""Images inside tool results in the three wire formats: found, replaced by text, or moved to a
user turn; the client's body is never changed."""

from __future__ import annotations

import copy
from typing import Any

from gateway.dialects.tool_results import IMAGES_FOLLOW, move_images, replace_images, tool_images

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC"
URL = "data:image/png;base64," + PNG


def messages_body() -> dict[str, Any]:
    """Claude Code's `Read` of a screenshot, then its reminder text in the same user turn."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    return {
        "messages": [
            {"role": "user", "content": "look at it"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [image]},
                    {"type": "text", "text": "<system-reminder>x</system-reminder>"},
                ],
            },
        ]
    }


def responses_body() -> dict[str, Any]:
    """Codex's `view_image`: a function_call_output whose output list holds an input_image."""
    return {
        "input": [
            {"role": "user", "content": "look"},
            {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_image", "image_url": URL}],
            },
            {"type": "function_call", "call_id": "c2", "name": "exec_command", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c2", "output": "done"},
            {"role": "user", "content": "and now?"},
        ]
    }


def chat_body() -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
    return {
        "messages": [
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": [
                    {"type": "text", "text": "shot:"},
                    {"type": "image_url", "image_url": {"url": URL}},
                ],
            },
        ]
    }


def test_images_are_found_in_each_wire_formats_tool_results() -> None:
    assert tool_images(messages_body()) == [URL]
    assert tool_images(responses_body()) == [URL]
    assert tool_images(chat_body()) == [URL]
    assert tool_images({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) == []


def test_a_described_image_becomes_a_text_part_in_the_clients_copy_only() -> None:
    for body, text_type in (
        (messages_body(), "text"),
        (responses_body(), "input_text"),
        (chat_body(), "text"),
    ):
        client = copy.deepcopy(body)
        sent = dict(client)
        assert replace_images(sent, {URL: "a login form"}) == 1
        assert client == body  # copy-on-write
        assert tool_images(sent) == []
        assert {"type": text_type, "text": "a login form"} in _all_parts(sent)


def test_for_a_vision_model_codex_images_move_to_a_user_message_after_the_run_of_outputs() -> None:
    body = responses_body()
    client = copy.deepcopy(body)
    assert move_images(body) == 1
    kinds = [item.get("type", item.get("role")) for item in body["input"]]
    assert kinds == [
        "user",
        "function_call",
        "function_call_output",
        "message",
        "function_call",
        "function_call_output",
        "user",
    ]
    moved = body["input"][3]
    assert moved["role"] == "user" and moved["content"][0] == {"type": "input_text", "text": IMAGES_FOLLOW}
    assert moved["content"][1] == {"type": "input_image", "image_url": URL}
    assert client == responses_body()


def test_for_a_vision_model_claude_images_follow_the_tool_results_in_the_same_turn() -> None:
    body = messages_body()
    assert move_images(body) == 1
    content = body["messages"][2]["content"]
    assert [block["type"] for block in content] == ["tool_result", "text", "image", "text"]
    assert content[1]["text"] == IMAGES_FOLLOW and content[3]["text"].startswith("<system-reminder>")
    assert tool_images(body) == []


def test_for_a_vision_model_chat_images_move_after_the_tool_messages() -> None:
    body = chat_body()
    assert move_images(body) == 1
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "user"]
    assert body["messages"][3]["content"][1]["type"] == "image_url"


def test_a_body_without_tool_images_is_left_as_it_came() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    messages = body["messages"]
    assert move_images(body) == 0 and body["messages"] is messages
    assert replace_images(body, {URL: "x"}) == 0 and body["messages"] is messages


def _all_parts(body: dict[str, Any]) -> list[Any]:
    parts: list[Any] = []
    for turn in body.get("messages", []) + body.get("input", []):
        for key in ("content", "output"):
            value = turn.get(key) if isinstance(turn, dict) else None
            if isinstance(value, list):
                for part in value:
                    parts.append(part)
                    if isinstance(part, dict) and isinstance(part.get("content"), list):
                        parts += part["content"]
    return parts
