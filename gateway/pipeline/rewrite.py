"""Pure request rewrites: the only keys of a client's body that the gateway owns.

`messages`, `tools` and every key not named here are forwarded as the client sent them, in the
client's order: both engines render `tools` and the keys inside `parameters` in the order they
arrive, and a single changed byte in the rendered prompt ends the prefix-cache hit at that point
(shared/BACKENDS.md §6). Injected values are constants, so they are identical on every request.

Each function returns the notes it applied as `(kind, text)`: `kind` is a bounded metric label,
`text` goes to the `x-gateway-rewrites` header and the access log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.errors import BadRequest
from gateway.routing.table import Preset

Endpoint = Literal["chat", "completions"]
Note = tuple[str, str]

# Fields some proxies accept to pick an upstream: a body must never choose where it is sent.
UPSTREAM_FIELDS = ("api_base", "base_url", "api_key", "extra_headers", "url", "custom_llm_provider")
GATEWAY_FIELDS = ("task",)
MAX_TOKEN_KEYS = ("max_completion_tokens", "max_tokens")  # vLLM: the first wins when both are set


@dataclass
class Plan:
    """What the rewrite decided; the body itself is changed in place."""

    stream: bool
    client_wants_usage: bool
    usage_injected: bool = False
    notes: list[Note] = field(default_factory=list)

    def header(self) -> str:
        return ",".join(text for _, text in self.notes)


def check_request(body: dict[str, Any], endpoint: Endpoint) -> None:
    """Reject what no backend can serve before any replica is bothered with it."""
    for name in UPSTREAM_FIELDS:
        if name in body:
            raise BadRequest(
                f"The field '{name}' is not accepted: the gateway chooses the upstream", param=name
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array", param="messages")
    elif "prompt" not in body:
        raise BadRequest("'prompt' is required", param="prompt")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    for key in MAX_TOKEN_KEYS:
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise BadRequest(f"'{key}' must be a positive integer", param=key)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")


def requested_task(body: dict[str, Any], header: str | None) -> str | None:
    task = body.get("task", header)
    if task is not None and not isinstance(task, str):
        raise BadRequest("'task' must be a string", param="task")
    return task


def rewrite(body: dict[str, Any], preset: Preset, endpoint: Endpoint, *, want_usage: bool) -> Plan:
    """Apply the preset to a checked body. Idempotent: a second pass changes nothing."""
    stream = body.get("stream") is True
    options = body.get("stream_options")
    client_wants_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    plan = Plan(stream=stream, client_wants_usage=client_wants_usage)
    for name in GATEWAY_FIELDS:
        body.pop(name, None)
    # vLLM answers 404 to any name but its --served-model-name; llama-server ignores it.
    body["model"] = preset.served_model
    if endpoint == "chat":
        _thinking(body, preset, plan)
    _max_tokens(body, preset, plan)
    _params(body, preset, plan)
    if want_usage and stream and not client_wants_usage:
        # Token counts for the metrics; the extra usage chunk is removed before it reaches the client.
        # Never on a non-streaming request: vLLM answers 400 to stream_options without stream.
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        plan.usage_injected = True
    return plan


def _thinking(body: dict[str, Any], preset: Preset, plan: Plan) -> None:
    kwargs = body.get("chat_template_kwargs")
    value = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        # A string "false" is a 400 on llama-server and silently means "think" on vLLM.
        fixed = value.strip().lower() == "true"
        body["chat_template_kwargs"] = {**kwargs, "enable_thinking": fixed}  # type: ignore[dict-item]
        plan.notes.append(("thinking_kwarg_fixed", f"enable_thinking={str(fixed).lower()}"))
        return
    if preset.thinking or value is not None:
        return  # the client's own choice wins
    if "reasoning_effort" in body:
        return  # vLLM derives enable_thinking from it; the client has chosen
    body["chat_template_kwargs"] = {**(kwargs or {}), "enable_thinking": False}
    plan.notes.append(("thinking_off", "thinking=off"))


def _max_tokens(body: dict[str, Any], preset: Preset, plan: Plan) -> None:
    # A runaway brake, not a throttle: thinking models charge 100-800 reasoning tokens to this
    # budget, so max_tokens=200 returns HTTP 200 with empty content.
    key = next((k for k in MAX_TOKEN_KEYS if body.get(k) is not None), None)
    if key is None:
        body["max_tokens"] = preset.max_tokens
        plan.notes.append(("max_tokens_set", f"max_tokens={preset.max_tokens}"))
        return
    value = body[key]
    if preset.min_max_tokens and value < preset.min_max_tokens:
        body[key] = preset.min_max_tokens
        plan.notes.append(("max_tokens_raised", f"{key}={value}->{preset.min_max_tokens}"))


def _params(body: dict[str, Any], preset: Preset, plan: Plan) -> None:
    filled = [name for name in preset.params if name not in body]
    for name in filled:
        body[name] = preset.params[name]
    if filled:
        plan.notes.append(("params", "params=" + "+".join(filled)))


def cap_to_context(body: dict[str, Any], context: int | None) -> tuple[dict[str, Any], Note | None]:
    """Per replica: vLLM rejects max_tokens above max_model_len with a 400."""
    if not context:
        return body, None
    key = next((k for k in MAX_TOKEN_KEYS if body.get(k) is not None), None)
    if key is None or body[key] <= context:
        return body, None
    capped = {**body, key: context}
    return capped, ("max_tokens_capped", f"{key}={body[key]}->{context}")
