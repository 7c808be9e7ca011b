"""The Anthropic Messages API (`/v1/messages`): what Claude Code and the Anthropic SDKs speak.

Both engines serve it natively (docs/engines.md §10). Differences from the OpenAI shapes that the
gateway must honour: errors are `{"type": "error", "error": {"type", "message"}}` and a stream
fails with an `event: error`; the stream has no `[DONE]`; `max_tokens` is required; usage is split
over `message_start` and `message_delta`, and `input_tokens` there excludes the cached tokens
(`cache_read_input_tokens`), which the record adds back so every dialect counts alike.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.answers.changes import Changes
from gateway.answers.tool_repair import tool_calls
from gateway.dialects.answer import Answer, as_int
from gateway.dialects.base import (
    MAX_RETRY_HINT,
    Dialect,
    ErrorReply,
    Note,
    optional,
    part_types,
    require_list,
)
from gateway.dialects.openai import (
    any_image_part,
    client_chose_thinking,
    fix_thinking_kwarg,
    read_openai_error,
    template_thinking_off,
)
from gateway.dialects.tool_history import tool_history
from gateway.errors import ContextExceeded, GatewayError

# The error types Anthropic's SDKs map to their exception classes, by HTTP status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# Fields only Anthropic's own service understands; a local engine renders nothing from them.
ANTHROPIC_ONLY = ("context_management", "mcp_servers", "container")


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicDialect(Dialect):
    """Anthropic Messages (`/v1/messages`, `count_tokens`): `{"type": "error"}` envelopes with 429
    for a busy fleet, `message_start` and ping events while a stream waits, usage and `stop_reason`
    read from the answer, and the fixes Claude Code's requests need on a local engine."""

    name = "anthropic"
    markers = (b'"usage"', b'"stop_reason":"')
    content = re.compile(rb'"text_delta"|"type":\s*"tool_use"|"input_json_delta"')
    reasoning = re.compile(rb'"thinking_delta"|"type":\s*"thinking"')
    token_keys = ("max_tokens",)
    opening_kinds = frozenset({"message_start"})

    def error_body(self, status: int, type_: str, message: str, code: str | int, param: str | None) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})

    def stream_error(self, message: str, code: str) -> bytes:
        payload = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"

    def error_message(self, payload: Any) -> tuple[str, str | None, str | int | None, str | None]:
        # `{"type": "error", "error": {...}}` and OpenAI's `{"error": {...}}` (llama-server's
        # answer on /v1/messages) hold the same fields under `error`.
        return read_openai_error(payload)

    def opening(self, *, request_id: str, model: str | None, input_tokens: int) -> bytes:
        """`message_start` with the prompt's tokens (Claude Code tracks its context from them and
        fails on a missing usage), as Anthropic's own API sends it before the answer is ready."""
        message: dict[str, Any] = {
            "id": f"msg_{request_id}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        payload = {"type": "message_start", "message": message}
        return b"event: message_start\ndata: " + orjson.dumps(payload) + b"\n\n"

    def keepalive(self) -> bytes:
        """Anthropic's own keep-alive event, which resets Claude Code's stream idle timer."""
        return b'event: ping\ndata: {"type": "ping"}\n\n'

    def describe(self, error: GatewayError) -> str:
        # Claude Code compacts its history and retries only on Anthropic's own wording, and lowers
        # its budget only on the other one (docs/agents.md).
        if (
            isinstance(error, ContextExceeded)
            and error.prompt_tokens is not None
            and error.context is not None
        ):
            if error.budget is not None:
                return (
                    f"input length and `max_tokens` exceed context limit: {error.prompt_tokens} + "
                    f"{error.budget} > {error.context}, decrease input length or `max_tokens` and try again"
                )
            return f"prompt is too long: {error.prompt_tokens} tokens > {error.context} maximum"
        return error.message

    def error_reply(
        self, error: GatewayError, *, streaming: bool, opened: bool, request_id: str, model: str | None
    ) -> ErrorReply:
        """Busy (a full queue, a limit, a slow load): 429 `rate_limit_error`, which Claude Code
        retries with back-off, honouring `retry-after` up to about a minute, never the 529 it gives
        up on after three; `x-should-retry` says whether a retry can succeed."""
        status = 429 if error.busy else error.status
        kind = error_type(status)
        message = self.describe(error)
        if opened:
            payload = {"type": "error", "error": {"type": kind, "message": message}}
            return ErrorReply(200, b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n", stream=True)
        headers = dict(error.headers)
        wait = error.retry_after
        retry = status >= 500 or status in (408, 409, 429)
        if wait is not None and wait > MAX_RETRY_HINT:
            # A day's limit: no retry within the agent's patience can succeed; the true wait stays
            # in `retry-after` for whoever reads it.
            retry = False
        elif wait is not None:
            headers["retry-after"] = str(max(1, wait))
        headers["x-should-retry"] = "true" if retry else "false"
        body = orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
        return ErrorReply(status, body, tuple(headers.items()))

    # --- answers --------------------------------------------------------------------------------
    def read_whole(self, answer: Answer, payload: dict[str, Any]) -> None:
        _usage(answer, payload.get("usage"))
        _stop(answer, payload.get("stop_reason"))
        content = payload.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict):
                    _block(answer, block)

    def read_event(self, answer: Answer, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        if kind == "message_start":
            message = payload.get("message")
            if isinstance(message, dict):
                _usage(answer, message.get("usage"))
        elif kind == "message_delta":
            _usage(answer, payload.get("usage"))
            delta = payload.get("delta")
            if isinstance(delta, dict):
                _stop(answer, delta.get("stop_reason"))

    # --- requests -------------------------------------------------------------------------------
    def check(self, body: dict[str, Any], endpoint: str, odd_types: bool = True) -> None:
        require_list(body, "messages")
        if odd_types:
            part_types(body["messages"], "messages")
        optional(body, "system", (str, list), "a string or an array of text blocks")
        optional(body, "thinking", dict, "an object")

    def has_images(self, body: dict[str, Any]) -> bool:
        return any_image_part(body.get("messages"), "content")

    def thinks(self, body: dict[str, Any]) -> bool:
        thinking = body.get("thinking")
        disabled = isinstance(thinking, dict) and thinking.get("type") == "disabled"
        return super().thinks(body) and not disabled

    def thinking(self, body: dict[str, Any], on: bool, override: bool) -> list[Note]:
        """Turns thinking off in the body unless the preset wants it on or the client chose it (and
        no `override`); Claude Code's `adaptive` setting is no choice. Sets `thinking: disabled` and
        the template switch off, and returns the notes for `x-gateway-rewrites`."""
        fixed = fix_thinking_kwarg(body)
        if fixed:
            return fixed
        thinking = body.get("thinking")
        # Claude Code sends `thinking: {type: adaptive}` on every call ("think if it helps"): that
        # is no choice of the client's, so the preset decides. On a local thinking model it
        # would cost 100-800 tokens before each answer.
        adaptive = isinstance(thinking, dict) and thinking.get("type") == "adaptive"
        keys = () if adaptive else ("thinking",)
        if on or (not override and client_chose_thinking(body, keys)):
            return []
        notes: list[Note] = []
        if thinking is not None:
            body["thinking"] = {"type": "disabled"}
            notes.append(("thinking_overridden", "thinking=disabled"))
        return notes + template_thinking_off(body)

    def fixes(
        self, body: dict[str, Any], wanted: frozenset[str], changes: Changes | None = None
    ) -> list[Note]:
        """Applies the `wanted` Messages fixes to the body in place (the billing line, system turns,
        Anthropic-only fields), always the tool-history rules, and adds the tool-call changes to
        `changes` when given; returns the notes for `x-gateway-rewrites`."""
        notes: list[Note] = []
        if "billing_header" in wanted:
            notes += billing_header(body)
        if "system_in_turns" in wanted:
            notes += system_in_turns(body)
        if "anthropic_only_fields" in wanted:
            dropped = [name for name in ANTHROPIC_ONLY if body.pop(name, None) is not None]
            if dropped:
                notes.append(("anthropic_only_fields", "dropped=" + "+".join(dropped)))
        notes += tool_history(body, "messages", strict="tool_pairing" in wanted)
        if changes is not None:
            tool_calls(body, changes, "messages", repair="tool_call_repair" in wanted)
        return notes


BILLING_PREFIX = "x-anthropic-billing-header:"


def billing_header(body: dict[str, Any]) -> list[Note]:
    """Claude Code opens its system prompt with a billing line for Anthropic's service
    (`x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=cli;`, some versions with
    a per-request `cch=`); its suffix changes with the prompt, so at the very start of the prompt
    it makes every session's prefix differ from the first byte. A local model has no use for it:
    the block is removed, and the rest of the system prompt keeps its bytes."""
    system = body.get("system")
    if isinstance(system, str) and system.startswith(BILLING_PREFIX):
        _, _, rest = system.partition("\n")
        body["system"] = rest.lstrip("\n")
        return [("billing_header", "billing_header=removed")]
    if not isinstance(system, list):
        return []
    kept = [
        block
        for block in system
        if not (isinstance(block, dict) and str(block.get("text", "")).startswith(BILLING_PREFIX))
    ]
    if len(kept) == len(system):
        return []
    body["system"] = kept
    return [("billing_header", "billing_header=removed")]


def system_in_turns(body: dict[str, Any]) -> list[Note]:
    """Claude Code puts `system`-role messages after the first user turn (reminders); Qwen3's chat
    template raises "System message must be at the beginning" on them. Each becomes a user turn
    in place: the bytes before it stay as sent, so the prefix cache still covers them."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    changed: list[Any] | None = None  # copied on the first change: the client's list stays as it came
    moved = 0
    for index, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "system":
            if changed is None:
                changed = list(messages)
            changed[index] = {**message, "role": "user"}
            moved += 1
    if changed is None:
        return []
    body["messages"] = changed
    return [("system_in_turns", f"system_in_turns={moved}")]


def _usage(answer: Answer, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    fresh = as_int(usage.get("input_tokens"), None)
    read = as_int(usage.get("cache_read_input_tokens"), None)
    created = as_int(usage.get("cache_creation_input_tokens"), None)
    if fresh is not None:
        answer.prompt_tokens = fresh + (read or 0) + (created or 0)
    if read is not None:
        answer.cached_tokens = read
    answer.completion_tokens = as_int(usage.get("output_tokens"), answer.completion_tokens)


def _stop(answer: Answer, reason: Any) -> None:
    if isinstance(reason, str):
        answer.finish_reason = "length" if reason == "max_tokens" else reason


def _block(answer: Answer, block: dict[str, Any]) -> None:
    kind = block.get("type")
    if (kind == "text" and block.get("text")) or kind == "tool_use":
        answer.content_seen = True
    elif kind in ("thinking", "redacted_thinking"):
        answer.reasoning_seen = True


ANTHROPIC = AnthropicDialect()
