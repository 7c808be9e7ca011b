"""A Messages request sent to llama-server as a chat completion, and its chat stream read back as
Messages events (pure: bodies and bytes in, bodies and bytes out).

Why: llama-server's `/v1/messages` builds a new body from the fields it knows and drops `id_slot`
(docs/engines.md §13), so a Claude Code session cannot be pinned to the slot that holds its prompt,
and placement alone keeps only about 0.95 of its cache. Its chat endpoint honours `id_slot`. Under
`policy: session` the gateway therefore converts the request the way llama-server's own conversion
does (the same messages, in the same order, render the same prompt, so a session keeps its cache
whichever way a turn went), adds the slot, and turns the chat stream back into the Messages events
the engine would have sent: `message_start` with the prompt's cache figures (from the
`timings` that `timings_per_token` puts on every chunk), a block per text, thinking and tool call,
`message_delta` with the stop reason and usage, and `message_stop`.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import orjson

from gateway.answers.events import parse
from gateway.dialects.answer import as_int
from gateway.upstream import UpstreamError

CHAT_PATH = "/v1/chat/completions"
# The request fields llama-server's conversion keeps as they are; every other Messages field is
# dropped there too (cache_control stays inside the blocks it annotates, as the engine keeps it).
_KEPT = ("model", "temperature", "top_p", "top_k", "chat_template_kwargs")
_STOPS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
# An event held back until its blank line (a tool call's arguments may come in one event).
MAX_EVENT_BYTES = 16 * 1024 * 1024


class ChatEventTooLarge(UpstreamError):
    kind = "upstream_event_too_large"


# --- the request ---------------------------------------------------------------------------------


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body llama-server would have built from this Messages body, asked for as a stream
    with its usage and per-chunk timings (the prompt's cached tokens, for `message_start`)."""
    chat: dict[str, Any] = {key: body[key] for key in _KEPT if key in body}
    messages = _system(body.get("system"))
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            messages.extend(_message(message))
    chat["messages"] = messages
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [_tool(tool) for tool in tools if isinstance(tool, dict)]
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    if isinstance(body.get("tool_choice"), dict) and body["tool_choice"].get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body.get("max_tokens", 4096)  # the engine's own default when absent
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        chat["thinking_budget_tokens"] = thinking.get("budget_tokens", 10000)
    chat["stream"] = True
    chat["stream_options"] = {"include_usage": True}
    chat["timings_per_token"] = True
    return chat


def _system(system: Any) -> list[dict[str, Any]]:
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        text = "".join(
            str(block.get("text", ""))
            for block in system
            if isinstance(block, dict) and block.get("type") == "text"
        )
        return [{"role": "system", "content": text}]
    return []


def _message(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: its text, images, thinking and tool calls in one message,
    then one `tool` message per tool result (the engine's order)."""
    role = message.get("role")
    if "content" not in message:
        return [] if role == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):
        return [message]
    parts: list[Any] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(block)
        elif kind == "thinking":
            reasoning += str(block.get("thinking", ""))
        elif kind == "image":
            url = _image_url(block.get("source"))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input", {})).decode()
            function = {"name": str(block.get("name", "")), "arguments": arguments}
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": function})
        elif kind == "tool_result":
            results.append(_tool_result(block))
    out: list[dict[str, Any]] = []
    if parts or calls or reasoning:
        converted: dict[str, Any] = {"role": role, "content": parts or ""}
        if calls:
            converted["tool_calls"] = calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + results


def _image_url(source: Any) -> str | None:
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return None


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"role": "tool", "tool_call_id": str(block.get("tool_use_id", ""))}
    content = block.get("content")
    if isinstance(content, str):
        result["content"] = content
        return result
    if not isinstance(content, list):
        result["content"] = ""
        return result
    # Text alone is one string; with an image, the parts (the engine's choice, kept for the prompt).
    parts: list[dict[str, Any]] = []
    images = False
    for item in content:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "text":
            parts.append({"type": "text", "text": str(item.get("text", ""))})
        elif item.get("type") == "image":
            images = True
            url = _image_url(item.get("source"))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
    result["content"] = parts if images else "".join(part["text"] for part in parts)
    return result


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {
        "name": str(tool.get("name", "")),
        "description": str(tool.get("description", "")),
        "parameters": tool.get("input_schema", {}),
    }
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> str | None:
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind in ("any", "tool"):
        return "required"  # the engine's chat reads no named choice: any tool is the nearest
    if kind == "none":
        return "none"
    return None


# --- the answer ----------------------------------------------------------------------------------


class ChatStreamAsMessages:
    """Reads a llama-server chat stream in pieces and gives back the Messages events for it, cut at
    event boundaries; `end()` after the last piece. An error event in the chat stream becomes the
    Messages `error` event; a stream that ends without a finish reason gets no `message_stop`, so
    the relay sees it cut short, as it would the engine's own Messages stream."""

    def __init__(self, max_event: int = MAX_EVENT_BYTES) -> None:
        self.max_event = max_event
        self._pending = bytearray()
        self._started = False
        self._ended = False
        self._index = -1  # the current Messages content block
        self._open: str | None = None  # its kind: text | thinking | tool_use
        self._call: int | None = None  # the chat tool call index the open tool_use block is
        self._called = False
        self._id = ""
        self._model = ""
        self._timings: dict[str, Any] = {}
        self._usage: dict[str, Any] = {}
        self._stop: str | None = None

    def feed(self, chunk: bytes) -> bytes:
        # Only the new bytes (and the 3 before, for a boundary split across pieces) are searched:
        # an event that arrives a byte at a time must not cost quadratic time.
        start = max(0, len(self._pending) - 3)
        self._pending += chunk
        end = 0
        for match in _BOUNDARY.finditer(self._pending, start):
            end = match.end()
        if not end:
            if len(self._pending) > self.max_event:
                raise ChatEventTooLarge("a chat stream event passed the size limit")
            return b""
        block = bytes(self._pending[:end])
        del self._pending[:end]
        out: list[bytes] = []
        for event in parse(block):
            if event.data is not None:
                self._chunk(event.data, out)
            elif event.raw is not None and event.raw.strip().endswith(b"[DONE]"):
                self._finish(out)
        return b"".join(out)

    def end(self) -> bytes:
        out: list[bytes] = []
        if self._stop is not None:
            self._finish(out)
        return b"".join(out)

    def _chunk(self, data: dict[str, Any], out: list[bytes]) -> None:
        if self._ended:
            return
        error = data.get("error")
        if error is not None:
            self._error(error, out)
            return
        self._id = self._id or str(data.get("id") or "")
        self._model = self._model or str(data.get("model") or "")
        if isinstance(data.get("timings"), dict):
            self._timings = data["timings"]
        if isinstance(data.get("usage"), dict):
            self._usage = data["usage"]
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        delta = choice.get("delta")
        if isinstance(delta, dict):
            self._delta(delta, out)
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            self._close(out)
            self._stop = (
                "max_tokens"
                if reason == "length"
                else "tool_use"
                if self._called
                else _STOPS.get(reason, "end_turn")
            )

    def _delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            self._block("thinking", {"type": "thinking", "thinking": ""}, out)
            self._emit(
                out, "content_block_delta", {"delta": {"type": "thinking_delta", "thinking": reasoning}}
            )
        text = delta.get("content")
        if isinstance(text, str) and text:
            self._block("text", {"type": "text", "text": ""}, out)
            self._emit(out, "content_block_delta", {"delta": {"type": "text_delta", "text": text}})
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict):
                    self._tool_call(call, out)

    def _tool_call(self, call: dict[str, Any], out: list[bytes]) -> None:
        index = as_int(call.get("index"), 0)
        given = call.get("function")
        function: dict[str, Any] = given if isinstance(given, dict) else {}
        if self._open != "tool_use" or index != self._call or call.get("id"):
            self._close(out)
            block = {
                "type": "tool_use",
                "id": str(call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"),
                "name": str(function.get("name") or ""),
                "input": {},
            }
            self._block("tool_use", block, out)
            self._call, self._called = index, True
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            self._emit(
                out, "content_block_delta", {"delta": {"type": "input_json_delta", "partial_json": arguments}}
            )

    def _block(self, kind: str, start: dict[str, Any], out: list[bytes]) -> None:
        self._start(out)
        if self._open == kind and kind != "tool_use":
            return
        self._close(out)
        self._index += 1
        self._open = kind
        self._emit(out, "content_block_start", {"content_block": start})

    def _close(self, out: list[bytes]) -> None:
        if self._open is not None:
            self._emit(out, "content_block_stop", {})
            self._open, self._call = None, None

    def _start(self, out: list[bytes]) -> None:
        if self._started:
            return
        self._started = True
        prompt, cached = self._prompt()
        message: dict[str, Any] = {
            "id": self._id or f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self._model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"cache_read_input_tokens": cached, "input_tokens": prompt - cached, "output_tokens": 0},
        }
        out.append(_event("message_start", {"type": "message_start", "message": message}))

    def _prompt(self) -> tuple[int, int]:
        """The prompt's tokens and how many the engine found cached: the final usage where it came,
        else the timings of the first token (fresh `prompt_n` plus cached `cache_n`)."""
        usage = self._usage
        if usage:
            prompt = as_int(usage.get("prompt_tokens"), 0) or 0
            details = usage.get("prompt_tokens_details")
            cached = as_int(details.get("cached_tokens"), 0) if isinstance(details, dict) else 0
            return prompt, min(cached or 0, prompt)
        fresh = as_int(self._timings.get("prompt_n"), 0) or 0
        cached = as_int(self._timings.get("cache_n"), 0) or 0
        return fresh + cached, cached

    def _finish(self, out: list[bytes]) -> None:
        if self._ended or self._stop is None:
            return
        self._start(out)
        self._close(out)
        prompt, cached = self._prompt()
        output = as_int(self._usage.get("completion_tokens"), None)
        if output is None:
            output = as_int(self._timings.get("predicted_n"), 0) or 0
        usage = {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "output_tokens": output}
        delta = {"stop_reason": self._stop, "stop_sequence": None}
        out.append(_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        self._ended = True

    def _error(self, error: Any, out: list[bytes]) -> None:
        message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
        kind = error.get("type") if isinstance(error, dict) else None
        payload = {
            "type": "error",
            "error": {"type": kind if isinstance(kind, str) else "api_error", "message": message},
        }
        out.append(_event("error", payload))
        self._ended = True

    def _emit(self, out: list[bytes], name: str, payload: dict[str, Any]) -> None:
        if "index" not in payload and name.startswith("content_block"):
            payload = {"type": name, "index": self._index, **payload}
        out.append(_event(name, payload))


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
