"""Streams in each dialect as the engines send them, built from pieces of text, and the helpers that
run them through a request's changes and assemble what the client gets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from gateway.answers.assemble import Assembler, ChatAssembler, MessagesAssembler, ResponsesAssembler
from gateway.answers.changes import Changes
from gateway.answers.events import Event, encode, parse

Json = dict[str, Any]
BASH = {
    "type": "object",
    "properties": {"command": {"type": "string"}},
    "required": ["command"],
    "additionalProperties": False,
}
XML = "<tool_call>\n<function=Bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>"
ARGUMENTS = {"command": "ls -la"}


def sse(data: Json, name: str | None = None) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


# --- requests -----------------------------------------------------------------------------------


def chat_body(**extra: Any) -> Json:
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": BASH}}]
    return {"messages": [{"role": "user", "content": "list"}], "tools": tools, **extra}


def messages_body(**extra: Any) -> Json:
    return {
        "messages": [{"role": "user", "content": "list"}],
        "tools": [{"name": "Bash", "input_schema": BASH}],
        **extra,
    }


def responses_body(**extra: Any) -> Json:
    return {"input": "list", "tools": [{"type": "function", "name": "Bash", "parameters": BASH}], **extra}


# --- chat completions ---------------------------------------------------------------------------

CHAT_HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chat_chunk(delta: Json, finish: str | None = None, **extra: Any) -> bytes:
    return sse({**CHAT_HEAD, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})


def chat_stream(
    pieces: list[str],
    *,
    engine: str = "llamacpp",
    reasoning: Sequence[str] = (),
    calls: Sequence[Json] = (),
    finish: str = "stop",
) -> list[bytes]:
    """llama-server sends an empty chunk with the finish reason; vLLM puts it on the last token's."""
    field = "reasoning" if engine == "vllm" else "reasoning_content"
    deltas: list[Json] = [{field: r} for r in reasoning] + [{"content": p} for p in pieces]
    deltas += [{"tool_calls": [c]} for c in calls]
    out = [chat_chunk({"role": "assistant", "content": ""})]
    for n, delta in enumerate(deltas):
        last = engine == "vllm" and n == len(deltas) - 1
        out.append(chat_chunk(delta, finish if last else None))
    if engine != "vllm" or not deltas:
        out.append(chat_chunk({}, finish))
    return [*out, b"data: [DONE]\n\n"]


# --- Anthropic Messages -------------------------------------------------------------------------


def messages_stream(
    pieces: list[str], *, thinking: Sequence[str] = (), stop: str = "end_turn"
) -> list[bytes]:
    def event(name: str, data: Json) -> bytes:
        return sse({"type": name, **data}, name)

    start = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m"}
    out = [event("message_start", {"message": {**start, "usage": {"input_tokens": 5, "output_tokens": 0}}})]
    index = 0
    if thinking:
        out.append(
            event("content_block_start", {"index": 0, "content_block": {"type": "thinking", "thinking": ""}})
        )
        out += [
            event("content_block_delta", {"index": 0, "delta": {"type": "thinking_delta", "thinking": t}})
            for t in thinking
        ]
        out.append(event("content_block_stop", {"index": 0}))
        index = 1
    if pieces:
        out.append(
            event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
        )
        out += [
            event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": p}})
            for p in pieces
        ]
        out.append(event("content_block_stop", {"index": index}))
    out.append(
        event(
            "message_delta",
            {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 9}},
        )
    )
    return [*out, event("message_stop", {})]


# --- Responses ----------------------------------------------------------------------------------


def responses_stream(pieces: list[str], *, reasoning: Sequence[str] = ()) -> list[bytes]:
    sequence = iter(range(1000))
    out: list[bytes] = []

    def event(name: str, data: Json) -> None:
        out.append(sse({"type": name, "sequence_number": next(sequence), **data}, name))

    response: Json = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    event("response.created", {"response": response})
    event("response.in_progress", {"response": response})
    items: list[Json] = []
    if reasoning:
        text = "".join(reasoning)
        item = {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }
        at = {"item_id": "rs_1", "output_index": len(items)}
        event("response.output_item.added", {"output_index": len(items), "item": {**item, "content": []}})
        for piece in reasoning:
            event("response.reasoning_text.delta", {**at, "content_index": 0, "delta": piece})
        event("response.reasoning_text.done", {**at, "content_index": 0, "text": text})
        event("response.output_item.done", {"output_index": len(items), "item": item})
        items.append(item)
    if pieces:
        text = "".join(pieces)
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }
        at = {"item_id": "msg_1", "output_index": len(items)}
        event(
            "response.output_item.added",
            {"output_index": len(items), "item": {**item, "content": [], "status": "in_progress"}},
        )
        event("response.content_part.added", {**at, "content_index": 0, "part": {**part, "text": ""}})
        for piece in pieces:
            event("response.output_text.delta", {**at, "content_index": 0, "delta": piece})
        event("response.output_text.done", {**at, "content_index": 0, "text": text})
        event("response.content_part.done", {**at, "content_index": 0, "part": part})
        event("response.output_item.done", {"output_index": len(items), "item": item})
        items.append(item)
    event("response.completed", {"response": {**response, "status": "completed", "output": items}})
    return out


# --- running them -------------------------------------------------------------------------------


def relayed(changes: Changes, blocks: list[bytes]) -> list[Event]:
    """What the client gets: each block through the changes as the relay hands it on, then the end."""
    out: list[Event] = []
    for block in blocks:
        out += parse(encode(changes.stream(parse(block))))
    return out + parse(encode(changes.end()))


def assembled(events: list[Event], assembler: Assembler) -> Json:
    for event in events:
        assembler.feed(event)
    return assembler.result()


def chat_result(events: list[Event]) -> Json:
    return assembled(events, ChatAssembler())


def messages_result(events: list[Event]) -> Json:
    return assembled(events, MessagesAssembler())


def responses_result(events: list[Event]) -> Json:
    return assembled(events, ResponsesAssembler())
