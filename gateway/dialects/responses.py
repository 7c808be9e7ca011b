"""The OpenAI Responses API (`/v1/responses`): the only wire format current Codex speaks.

Errors keep the OpenAI envelope; a stream is typed events (`event: response.output_text.delta`
...) that end with `response.completed` (or `.incomplete`, `.failed`) carrying the whole response
and its usage, with no `[DONE]`. `usage.input_tokens` includes the cached tokens
(`input_tokens_details.cached_tokens`). A budget cut shows as `status: "incomplete"` with
`incomplete_details.reason: "max_output_tokens"` (llama-server) or on the message item (vLLM).
"""

from __future__ import annotations

import re
import time
from typing import Any

import orjson

from gateway.answers.changes import Changes
from gateway.answers.tool_repair import tool_calls
from gateway.dialects.answer import Answer, as_int, as_str
from gateway.dialects.base import MAX_RETRY_HINT, Dialect, ErrorReply, Note, optional, part_types
from gateway.dialects.codex import codex_tools, reasoning_replay
from gateway.dialects.openai import (
    any_image_part,
    client_chose_thinking,
    fix_thinking_kwarg,
    openai_error,
    openai_overflow,
    read_openai_error,
    template_thinking_off,
)
from gateway.dialects.tool_history import tool_history
from gateway.errors import BadRequest, ContextExceeded, GatewayError

_FINAL = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"', b'"response.created"')


class ResponsesDialect(Dialect):
    """The OpenAI Responses API as Codex speaks it: OpenAI error envelopes, `response.created` and
    `response.in_progress` while a stream waits, `response.failed` for busy and overflow so Codex
    retries or compacts, usage and status read from the response, and the Codex fixes."""

    name = "responses"
    markers = _FINAL
    content = re.compile(rb'"response\.output_text\.delta"|"type":\s*"function_call"')
    reasoning = re.compile(rb'"response\.reasoning')
    token_keys = ("max_output_tokens",)
    opening_kinds = frozenset({"response.created", "response.in_progress"})

    def error_body(self, status: int, type_: str, message: str, code: str | int, param: str | None) -> bytes:
        return openai_error(message, type_, code, param)

    def stream_error(self, message: str, code: str) -> bytes:
        payload = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"

    def error_message(self, payload: Any) -> tuple[str, str | None, str | int | None, str | None]:
        return read_openai_error(payload)

    def opening(self, *, request_id: str, model: str | None, input_tokens: int) -> bytes:
        """`response.created` and `response.in_progress`, as OpenAI's API opens every stream."""
        response = _response(request_id, model, "in_progress")
        return _event(
            "response.created", {"type": "response.created", "sequence_number": 0, "response": response}
        ) + _event(
            "response.in_progress",
            {"type": "response.in_progress", "sequence_number": 1, "response": response},
        )

    def keepalive(self) -> bytes:
        # An event, not a comment: a client's SSE parser drops comments before its idle timer sees
        # them (Codex's stream_idle_timeout counts parsed events); `response.in_progress` is an event
        # every Responses client knows and ignores.
        return _event("response.in_progress", {"type": "response.in_progress", "sequence_number": 1})

    def describe(self, error: GatewayError) -> str:
        overflow = openai_overflow(error)
        if overflow is not None:
            return overflow
        if error.busy:
            # Codex waits as long as this sentence says, then retries (docs/agents.md).
            wait = max(1, min(error.retry_after or 1, MAX_RETRY_HINT))
            return f"{error.message.rstrip('. ')}. Please try again in {wait}s."
        return error.message

    def error_reply(
        self, error: GatewayError, *, streaming: bool, opened: bool, request_id: str, model: str | None
    ) -> ErrorReply:
        """A stream that fails for a busy fleet or an overflowing prompt ends with `response.failed`
        carrying `rate_limit_exceeded` or `context_length_exceeded`: Codex treats an HTTP error as
        fatal, and waits and retries, or compacts, only on those events. Without a stream, the
        same codes in an error response."""
        code = (
            "context_length_exceeded"
            if isinstance(error, ContextExceeded)
            else "rate_limit_exceeded"
            if error.busy
            else None
        )
        if code is None or not (streaming or opened):
            reply = super().error_reply(
                error, streaming=streaming, opened=opened, request_id=request_id, model=model
            )
            if code is None:
                return reply
            status = 429 if error.busy else error.status
            body = openai_error(self.describe(error), error.type, code, error.param)
            return ErrorReply(status, body, reply.headers)
        response = {
            **_response(request_id, model, "failed"),
            "error": {"code": code, "message": self.describe(error)},
        }
        events = b""
        if not opened:
            created = _response(request_id, model, "in_progress")
            events += _event(
                "response.created", {"type": "response.created", "sequence_number": 0, "response": created}
            )
        events += _event(
            "response.failed", {"type": "response.failed", "sequence_number": 1, "response": response}
        )
        return ErrorReply(200, events, stream=True)

    # --- answers --------------------------------------------------------------------------------
    def read_whole(self, answer: Answer, payload: dict[str, Any]) -> None:
        """Reads a whole response (or a final event's) into `answer`: its id, token usage with
        cached and reasoning tokens, the finish reason (`length` for a budget cut, `stop` when
        completed), and what its output items showed."""
        answer.response_id = as_str(payload.get("id"), answer.response_id)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            answer.prompt_tokens = as_int(usage.get("input_tokens"), answer.prompt_tokens)
            answer.completion_tokens = as_int(usage.get("output_tokens"), answer.completion_tokens)
            details = usage.get("input_tokens_details")
            if isinstance(details, dict):
                answer.cached_tokens = as_int(details.get("cached_tokens"), answer.cached_tokens)
            out = usage.get("output_tokens_details")
            if isinstance(out, dict):
                answer.reasoning_tokens = as_int(out.get("reasoning_tokens"), answer.reasoning_tokens)
        status = payload.get("status")
        incomplete = payload.get("incomplete_details")
        reason = incomplete.get("reason") if isinstance(incomplete, dict) else None
        if reason == "max_output_tokens":
            answer.finish_reason = "length"
        elif isinstance(status, str) and status != "in_progress":
            answer.finish_reason = "stop" if status == "completed" else status
        output = payload.get("output")
        if isinstance(output, list):
            for item in output:
                if isinstance(item, dict):
                    _item(answer, item)

    def read_event(self, answer: Answer, payload: dict[str, Any]) -> None:
        response = payload.get("response")
        if isinstance(response, dict):
            self.read_whole(answer, response)

    # --- requests -------------------------------------------------------------------------------
    def check(self, body: dict[str, Any], endpoint: str, odd_types: bool = True) -> None:
        given = body.get("input")
        if not isinstance(given, (str, list)) or not given:
            raise BadRequest("'input' must be a non-empty string or array", param="input")
        if odd_types:
            part_types(given, "input")
        optional(body, "reasoning", dict, "an object")
        # The id names the stored answer a replica continues (and the replica it is on): only a
        # string can name one, and anything else would reach the engine unchecked.
        optional(body, "previous_response_id", str, "a string (the id of a stored response)")

    def has_images(self, body: dict[str, Any]) -> bool:
        return any_image_part(body.get("input"), "content")

    def thinks(self, body: dict[str, Any]) -> bool:
        reasoning = body.get("reasoning")
        off = isinstance(reasoning, dict) and reasoning.get("effort") == "none"
        return super().thinks(body) and not off

    def thinking(self, body: dict[str, Any], on: bool, override: bool) -> list[Note]:
        fixed = fix_thinking_kwarg(body)
        if fixed:
            return fixed
        reasoning = body.get("reasoning")
        chose = isinstance(reasoning, dict) and "effort" in reasoning
        if on or (not override and (chose or client_chose_thinking(body, ()))):
            return []
        notes: list[Note] = []
        if chose:
            body["reasoning"] = {**reasoning, "effort": "none"}  # type: ignore[dict-item]
            notes.append(("thinking_overridden", "reasoning.effort=none"))
        return notes + template_thinking_off(body)

    def fixes(
        self, body: dict[str, Any], wanted: frozenset[str], changes: Changes | None = None
    ) -> list[Note]:
        """Applies the `wanted` Responses fixes to the body in place (Codex lite, Codex tools,
        reasoning replay, system items, unknown tool types), always the tool-history rules, and adds
        the answer's changes to `changes` when given; returns the notes for `x-gateway-rewrites`."""
        notes: list[Note] = []
        if "codex_lite" in wanted:
            notes += codex_lite(body)
        if "codex_tools" in wanted:
            notes += codex_tools(body, changes)
        if "reasoning_replay" in wanted:
            notes += reasoning_replay(body)
        if "system_in_turns" in wanted:
            notes += system_items_in_turns(body)
        if "unknown_tool_types" in wanted:
            notes += unknown_tool_types(body)
        notes += tool_history(body, "responses", strict="tool_pairing" in wanted)
        if changes is not None:
            tool_calls(body, changes, "responses", repair="tool_call_repair" in wanted)
        return notes


def _response(request_id: str, model: str | None, status: str) -> dict[str, Any]:
    """A response object the gateway writes itself (opening a stream, or failing one)."""
    return {
        "id": f"resp_{request_id}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
    }


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def codex_lite(body: dict[str, Any]) -> list[Note]:
    """Codex's lighter request form carries its tools in an `additional_tools` input item, which
    llama-server rejects ("Cannot determine type of 'item'"): the tools go where every engine
    reads them. Only the item moves; the other input items keep their bytes and order."""
    items = body.get("input")
    if not isinstance(items, list):
        return []
    tools: list[Any] = []
    kept = []
    for item in items:
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            extra = item.get("tools")
            tools.extend(extra if isinstance(extra, list) else [])
        else:
            kept.append(item)
    if len(kept) == len(items):
        return []
    body["input"] = kept
    existing = body.get("tools")
    body["tools"] = [*(existing if isinstance(existing, list) else []), *tools]
    return [("codex_lite", f"additional_tools={len(tools)}")]


_SYSTEM_ROLES = ("system", "developer")


def system_items_in_turns(body: dict[str, Any]) -> list[Note]:
    """llama-server renders `developer` as `system`; a Qwen3-style template raises "System message
    must be at the beginning" on any that is not first (after `instructions`, or after a user
    turn). Each such item becomes a user item in place; the leading ones keep their bytes."""
    items = body.get("input")
    if not isinstance(items, list):
        return []
    leading = not body.get("instructions")
    changed: list[Any] | None = None  # copied on the first change: the client's list stays as it came
    moved = 0
    for index, item in enumerate(items):
        role = item.get("role") if isinstance(item, dict) else None
        if role in _SYSTEM_ROLES and leading:
            continue
        leading = False
        if role in _SYSTEM_ROLES:
            if changed is None:
                changed = list(items)
            changed[index] = {**item, "role": "user"}
            moved += 1
    if changed is None:
        return []
    body["input"] = changed
    return [("system_in_turns", f"system_in_turns={moved}")]


def unknown_tool_types(body: dict[str, Any]) -> list[Note]:
    """Tool types only OpenAI's service runs (`web_search`, hosted tools) have no meaning on a
    local engine; a `namespace` groups function tools, which are lifted out in its place."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return []
    out: list[Any] = []
    dropped = 0
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function" or kind is None:
            out.append(tool)
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            out.extend(t for t in tool["tools"] if isinstance(t, dict) and t.get("type") == "function")
            dropped += 1
        else:
            dropped += 1
    if not dropped:
        return []
    body["tools"] = out
    return [("unknown_tool_types", f"tools_dropped={dropped}")]


def _item(answer: Answer, item: dict[str, Any]) -> None:
    kind = item.get("type")
    if kind == "function_call":
        answer.content_seen = True
    elif kind == "reasoning":
        answer.reasoning_seen = True
    elif kind == "message":
        content = item.get("content")
        if isinstance(content, list) and any(
            isinstance(part, dict) and isinstance(part.get("text"), str) and part["text"] for part in content
        ):
            answer.content_seen = True


RESPONSES = ResponsesDialect()
