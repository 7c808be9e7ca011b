"""A whole answer as the events of its dialect's stream, for a streaming client of the loop.

Messages: `message_start`, per block `content_block_start` / a delta / `content_block_stop`
(text as `text_delta`, thinking as `thinking_delta` and `signature_delta`, a `tool_use` or
`server_tool_use` input as one `input_json_delta`; a tool result block arrives whole in its start),
`message_delta` with the stop reason and usage, `message_stop`. Responses: `response.created`,
`response.in_progress`, per output item `response.output_item.added`, its content events and
`response.output_item.done`, then `response.completed`. Each event is `(kind, bytes)`, so events
the client already had (a stream the gateway opened itself) can be left out by kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

Event = tuple[str, bytes]


def _event(kind: str, payload: Mapping[str, Any]) -> Event:
    return kind, b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def messages_events(message: Mapping[str, Any]) -> list[Event]:
    """A whole Messages answer as the events of its stream, each `(kind, bytes)`: `message_start`
    (usage with no output tokens yet), each block's start, delta(s) and stop, `message_delta` with
    the stop reason and usage, and `message_stop`."""
    given = message.get("usage")
    usage: dict[str, Any] = given if isinstance(given, dict) else {}
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 0},
    }
    events = [_event("message_start", {"type": "message_start", "message": start})]
    blocks = message.get("content")
    for index, block in enumerate(blocks if isinstance(blocks, list) else ()):
        if not isinstance(block, dict):
            continue
        events += _block_events(index, block)
    delta = {"stop_reason": message.get("stop_reason"), "stop_sequence": message.get("stop_sequence")}
    events.append(_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(_event("message_stop", {"type": "message_stop"}))
    return events


def _block_events(index: int, block: dict[str, Any]) -> list[Event]:
    kind = block.get("type")
    deltas: list[dict[str, Any]] = []
    if kind == "text":
        opened: dict[str, Any] = {**block, "text": ""}
        deltas.append({"type": "text_delta", "text": block.get("text", "")})
    elif kind == "thinking":
        opened = {**block, "thinking": "", "signature": ""}
        deltas.append({"type": "thinking_delta", "thinking": block.get("thinking", "")})
        deltas.append({"type": "signature_delta", "signature": block.get("signature", "")})
    elif kind in ("tool_use", "server_tool_use"):
        opened = {**block, "input": {}}
        deltas.append(
            {"type": "input_json_delta", "partial_json": orjson.dumps(block.get("input", {})).decode()}
        )
    else:
        opened = block
    events = [
        _event(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": opened}
        )
    ]
    events += [
        _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
        for d in deltas
    ]
    events.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    return events


class _Numbered:
    def __init__(self) -> None:
        self.number = 0
        self.events: list[Event] = []

    def add(self, kind: str, payload: dict[str, Any]) -> None:
        self.events.append(_event(kind, {"type": kind, "sequence_number": self.number, **payload}))
        self.number += 1


def responses_events(response: Mapping[str, Any]) -> list[Event]:
    out = _Numbered()
    opening = {**response, "status": "in_progress", "output": []}
    out.add("response.created", {"response": opening})
    out.add("response.in_progress", {"response": opening})
    items = response.get("output")
    for index, item in enumerate(items if isinstance(items, list) else ()):
        if isinstance(item, dict):
            _item_events(out, index, item)
    out.add("response.completed", {"response": dict(response)})
    return out.events


def _item_events(out: _Numbered, index: int, item: dict[str, Any]) -> None:
    kind, item_id = item.get("type"), item.get("id")
    if kind == "message":
        out.add(
            "response.output_item.added",
            {"output_index": index, "item": {**item, "content": [], "status": "in_progress"}},
        )
        for part_index, part in enumerate(item.get("content") or ()):
            where = {"item_id": item_id, "output_index": index, "content_index": part_index}
            empty = {**part, "text": ""} if isinstance(part, dict) and "text" in part else part
            out.add("response.content_part.added", {**where, "part": empty})
            if isinstance(part, dict) and part.get("type") == "output_text":
                out.add(
                    "response.output_text.delta", {**where, "delta": part.get("text", ""), "logprobs": []}
                )
                out.add("response.output_text.done", {**where, "text": part.get("text", ""), "logprobs": []})
            out.add("response.content_part.done", {**where, "part": part})
    elif kind == "function_call":
        out.add(
            "response.output_item.added",
            {"output_index": index, "item": {**item, "arguments": "", "status": "in_progress"}},
        )
        where = {"item_id": item_id, "output_index": index}
        out.add("response.function_call_arguments.delta", {**where, "delta": item.get("arguments", "")})
        out.add("response.function_call_arguments.done", {**where, "arguments": item.get("arguments", "")})
    elif kind == "web_search_call":
        out.add(
            "response.output_item.added", {"output_index": index, "item": {**item, "status": "in_progress"}}
        )
        where = {"item_id": item_id, "output_index": index}
        for phase in ("in_progress", "searching", "completed"):
            out.add(f"response.web_search_call.{phase}", where)
    else:
        out.add("response.output_item.added", {"output_index": index, "item": item})
    out.add("response.output_item.done", {"output_index": index, "item": item})


def events(endpoint: str, answer: Mapping[str, Any]) -> list[Event]:
    """The answer as its endpoint's stream events (`messages` or `responses`)."""
    return messages_events(answer) if endpoint == "messages" else responses_events(answer)
