"""The loop's whole answer as its dialect's stream events: rebuilt from the events, it is the
answer again; a stream the gateway already opened can leave the opening events out by kind."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.servertools.sse import events

MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "m",
    "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "server_tool_use", "id": "t1", "name": "web_search", "input": {"query": "fleet"}},
        {
            "type": "web_search_tool_result",
            "tool_use_id": "t1",
            "content": [
                {
                    "type": "web_search_result",
                    "url": "https://x.org",
                    "title": "X",
                    "encrypted_content": "s",
                    "page_age": None,
                }
            ],
        },
        {"type": "thinking", "thinking": "hmm", "signature": ""},
        {"type": "text", "text": "Found it."},
    ],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 10,
        "output_tokens": 5,
        "server_tool_use": {"web_search_requests": 1, "web_fetch_requests": 0},
    },
}


def payloads(endpoint: str, answer: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for kind, raw in events(endpoint, answer):
        head, data = raw.split(b"\ndata: ", 1)
        assert head == b"event: " + kind.encode() and data.endswith(b"\n\n")
        out.append((kind, orjson.loads(data)))
    return out


def test_a_messages_answer_rebuilt_from_its_events_is_the_answer() -> None:
    found = payloads("messages", MESSAGE)
    assert (
        found[0][0] == "message_start" and found[-2][0] == "message_delta" and found[-1][0] == "message_stop"
    )
    blocks: list[dict[str, Any]] = []
    for kind, data in found:
        if kind == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
            elif delta["type"] == "input_json_delta":
                block["input"] = orjson.loads(delta["partial_json"])
    assert blocks == MESSAGE["content"]
    assert found[-2][1]["delta"]["stop_reason"] == "end_turn" and found[-2][1]["usage"] == MESSAGE["usage"]


RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "output": [
        {
            "type": "web_search_call",
            "id": "ws_1",
            "status": "completed",
            "action": {"type": "search", "query": "q", "sources": []},
        },
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Done.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "c1",
            "name": "exec_command",
            "arguments": '{"cmd":"ls"}',
        },
    ],
    "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
}


def test_a_responses_answer_rebuilt_from_its_events_is_the_answer() -> None:
    found = payloads("responses", RESPONSE)
    kinds = [kind for kind, _ in found]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [data["sequence_number"] for _, data in found] == list(range(len(found)))
    done = [data["item"] for kind, data in found if kind == "response.output_item.done"]
    assert done == RESPONSE["output"] and found[-1][1]["response"] == RESPONSE
    text = "".join(data["delta"] for kind, data in found if kind == "response.output_text.delta")
    assert text == "Done." and "response.web_search_call.completed" in kinds
