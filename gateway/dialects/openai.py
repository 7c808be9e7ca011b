"""OpenAI chat and text completions: the dialect every OpenAI SDK and most agents speak.

vLLM reports reasoning in `reasoning`, llama-server in `reasoning_content`; cached prompt tokens
come from `usage.prompt_tokens_details.cached_tokens` (vLLM only with
--enable-prompt-tokens-details) or llama-server's `timings.cache_n` (docs/engines.md).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.answers.changes import Changes
from gateway.answers.tool_repair import tool_calls
from gateway.dialects.answer import Answer, as_int, as_str
from gateway.dialects.base import Dialect, Note, optional, part_types, require_list
from gateway.dialects.tool_history import tool_history
from gateway.errors import BadRequest, ContextExceeded, GatewayError

REASONING_KEYS = ("reasoning_content", "reasoning")
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})


def openai_error(message: str, type_: str, code: str | int, param: str | None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code, "param": param}})


def read_openai_error(payload: Any) -> tuple[str, str | None, str | int | None, str | None]:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        message = error.get("message")
        code = error.get("code")
        return (
            message if isinstance(message, str) else "",
            as_str(error.get("type"), None),
            code if isinstance(code, str | int) and not isinstance(code, bool) else None,
            as_str(error.get("param"), None),
        )
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return payload["message"], None, None, None  # very old vLLM: a flat error object
    return "", None, None, None


class OpenAIDialect(Dialect):
    """OpenAI chat and text completions: the `{"error": {...}}` envelope, a `data: {"error": ...}`
    event to end a broken stream, usage and finish reason from either engine's fields, the body
    check, thinking off through the template switch, and the tool-history and tool-call fixes."""

    name = "openai"
    markers = (b'"finish_reason":"', b'"usage"')
    content = re.compile(rb'"(?:content|text)":\s*"(?!")|"tool_calls":\s*\[\s*\{')
    reasoning = re.compile(rb'"reasoning(?:_content)?":\s*"(?!")')
    done = b"data: [DONE]"
    token_keys = ("max_completion_tokens", "max_tokens")  # vLLM: the first wins when both are set

    def error_body(self, status: int, type_: str, message: str, code: str | int, param: str | None) -> bytes:
        return openai_error(message, type_, code, param)

    def stream_error(self, message: str, code: str) -> bytes:
        payload = {"error": {"message": message, "type": "upstream_error", "code": code}}
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def error_message(self, payload: Any) -> tuple[str, str | None, str | int | None, str | None]:
        return read_openai_error(payload)

    def describe(self, error: GatewayError) -> str:
        return openai_overflow(error) or error.message

    def default_budget_key(self, endpoint: str) -> str:
        return "max_tokens"

    # --- answers --------------------------------------------------------------------------------
    def read_whole(self, answer: Answer, payload: dict[str, Any]) -> None:
        _read_usage(answer, payload)
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        answer.finish_reason = as_str(choice.get("finish_reason"), answer.finish_reason)
        message = choice.get("message")
        if isinstance(message, dict):
            _read_delta(answer, message)
        elif isinstance(choice.get("text"), str) and choice["text"]:
            answer.content_seen = True

    def read_event(self, answer: Answer, payload: dict[str, Any]) -> None:
        _read_usage(answer, payload)
        choices = payload.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            answer.finish_reason = as_str(choice.get("finish_reason"), answer.finish_reason)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                _read_delta(answer, delta)
            elif isinstance(choice.get("text"), str) and choice["text"]:
                answer.content_seen = True

    def injected_usage(self, payload: dict[str, Any]) -> bool:
        return payload.get("choices") == [] and "usage" in payload

    # --- requests -------------------------------------------------------------------------------
    def check(self, body: dict[str, Any], endpoint: str, odd_types: bool = True) -> None:
        if endpoint == "chat":
            require_list(body, "messages")
            if odd_types:
                part_types(body["messages"], "messages")
        elif "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        optional(body, "chat_template_kwargs", dict, "an object")
        optional(body, "stream_options", dict, "an object")

    def has_images(self, body: dict[str, Any]) -> bool:
        """Structural: an image content part in any message. Never scans base64 data."""
        return any_image_part(body.get("messages"), "content")

    def thinks(self, body: dict[str, Any]) -> bool:
        return super().thinks(body) and body.get("reasoning_effort") != "none"

    def fixes(
        self, body: dict[str, Any], wanted: frozenset[str], changes: Changes | None = None
    ) -> list[Note]:
        notes = tool_history(body, "chat", strict="tool_pairing" in wanted)
        if changes is not None:
            tool_calls(body, changes, "chat", repair="tool_call_repair" in wanted)
        return notes

    def thinking(self, body: dict[str, Any], on: bool, override: bool) -> list[Note]:
        fixed = fix_thinking_kwarg(body)
        if fixed:
            return fixed
        if on or (not override and client_chose_thinking(body, ("reasoning_effort",))):
            return []  # the client's own choice wins (vLLM derives enable_thinking from reasoning_effort)
        body.pop("reasoning_effort", None)
        return template_thinking_off(body)


def openai_overflow(error: GatewayError) -> str | None:
    """A prompt past the context in OpenAI's own words (which OpenAI clients and agents match on,
    with the code `context_length_exceeded`), the gateway's detail after them."""
    if not isinstance(error, ContextExceeded) or error.prompt_tokens is None or error.context is None:
        return None
    tokens, context = error.prompt_tokens, error.context
    if error.budget is not None:
        return (
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{tokens + error.budget} tokens ({tokens} in the messages, {error.budget} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    return (
        f"This model's maximum context length is {context} tokens. However, your messages resulted in "
        f"{tokens} tokens. Please reduce the length of the messages. ({error.message})"
    )


def any_image_part(items: Any, content_key: str) -> bool:
    if not isinstance(items, list):
        return False
    for item in items:
        content = item.get(content_key) if isinstance(item, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    return True
    return False


def fix_thinking_kwarg(body: dict[str, Any]) -> list[Note]:
    """A string "false" is a 400 on llama-server and silently means "think" on vLLM."""
    kwargs = body.get("chat_template_kwargs")
    value = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        fixed = value.strip().lower() == "true"
        body["chat_template_kwargs"] = {**kwargs, "enable_thinking": fixed}  # type: ignore[dict-item]
        return [("thinking_kwarg_fixed", f"enable_thinking={str(fixed).lower()}")]
    return []


def client_chose_thinking(body: dict[str, Any], keys: tuple[str, ...]) -> bool:
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is not None:
        return True
    return any(key in body for key in keys)


def template_thinking_off(body: dict[str, Any]) -> list[Note]:
    """Both engines pass `chat_template_kwargs` to the chat template: Qwen-style templates then
    render an empty think block. The value is a constant, so the prompt prefix stays stable."""
    kwargs = body.get("chat_template_kwargs")
    body["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": False}
    return [("thinking_off", "thinking=off")]


def _read_usage(answer: Answer, payload: dict[str, Any]) -> None:
    usage = payload.get("usage")
    if isinstance(usage, dict):
        answer.prompt_tokens = as_int(usage.get("prompt_tokens"), answer.prompt_tokens)
        answer.completion_tokens = as_int(usage.get("completion_tokens"), answer.completion_tokens)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            answer.cached_tokens = as_int(details.get("cached_tokens"), answer.cached_tokens)
        completion_details = usage.get("completion_tokens_details")
        if isinstance(completion_details, dict):
            answer.reasoning_tokens = as_int(
                completion_details.get("reasoning_tokens"), answer.reasoning_tokens
            )
    timings = payload.get("timings")
    if isinstance(timings, dict) and answer.cached_tokens is None:
        answer.cached_tokens = as_int(timings.get("cache_n"), None)


def _read_delta(answer: Answer, message: dict[str, Any]) -> None:
    content = message.get("content")
    if (isinstance(content, str) and content) or message.get("tool_calls"):
        answer.content_seen = True
    if any(isinstance(message.get(k), str) and message[k] for k in REASONING_KEYS):
        answer.reasoning_seen = True


OPENAI = OpenAIDialect()
