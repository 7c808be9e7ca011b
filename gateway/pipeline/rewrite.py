"""Pure request rewrites: the only keys of a client's body that the gateway owns.

Messages, tools and every key not named by a rule are forwarded as the client sent them, in the
client's order: both engines render tools and the keys inside their parameters in the order they
arrive, and a single changed byte in the rendered prompt ends the prefix-cache hit at that point
(docs/engines.md §9). Injected values are constants, so they are identical on every request.
Where a rule lives in a dialect's own fields (the token budget, thinking, compatibility fixes),
the dialect object applies it (gateway/dialects/).

Each rule returns the notes it applied as `(kind, text)`: `kind` is a bounded metric label,
`text` goes to the `x-gateway-rewrites` header and the access log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.dialects.base import Note
from gateway.dialects.openai import OPENAI
from gateway.dialects.registry import BY_NAME, Endpoint
from gateway.errors import BadRequest
from gateway.routing.table import Preset

# Fields some proxies accept to pick an upstream: a body must never choose where it is sent.
UPSTREAM_FIELDS = ("api_base", "base_url", "api_key", "extra_headers", "url", "custom_llm_provider")
GATEWAY_FIELDS = ("task",)


@dataclass
class Plan:
    """What the rewrite decided; the body itself is changed in place."""

    stream: bool
    client_wants_usage: bool
    usage_injected: bool = False
    notes: list[Note] = field(default_factory=list)


def _endpoint(endpoint: Endpoint | str) -> Endpoint:
    return BY_NAME[endpoint] if isinstance(endpoint, str) else endpoint


def check_request(body: dict[str, Any], endpoint: Endpoint | str) -> None:
    """Reject what no backend can serve before any replica is bothered with it."""
    spec = _endpoint(endpoint)
    for name in UPSTREAM_FIELDS:
        if name in body:
            raise BadRequest(
                f"The field '{name}' is not accepted: the gateway chooses the upstream", param=name
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    spec.validate(body)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    if spec.budget:
        for key in spec.dialect.token_keys:
            value = body.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise BadRequest(f"'{key}' must be a positive integer", param=key)


def requested_task(body: dict[str, Any], header: str | None) -> str | None:
    task = body.get("task", header)
    if task is not None and not isinstance(task, str):
        raise BadRequest("'task' must be a string", param="task")
    return task


def rewrite(body: dict[str, Any], preset: Preset, endpoint: Endpoint | str, *, want_usage: bool) -> Plan:
    """Apply the preset to a checked body. Idempotent: a second pass changes nothing."""
    spec = _endpoint(endpoint)
    dialect = spec.dialect
    stream = spec.streams and body.get("stream") is True
    options = body.get("stream_options")
    client_wants_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    plan = Plan(stream=stream, client_wants_usage=client_wants_usage)
    for name in GATEWAY_FIELDS:
        body.pop(name, None)
    # vLLM answers 404 to any name but its --served-model-name; llama-server ignores it.
    body["model"] = preset.served_model
    plan.notes += dialect.fixes(body, preset.compat)
    if spec.thinks:
        plan.notes += dialect.thinking(body, preset.thinking, preset.thinking_override)
    if spec.budget:
        _budget(body, preset, plan, spec)
        _params(body, preset, plan)
    if not stream and options is not None:
        # OpenAI ignores stream_options without a stream; vLLM answers 400 to it.
        del body["stream_options"]
        plan.notes.append(("stream_options_dropped", "stream_options=dropped"))
    if want_usage and stream and dialect is OPENAI and not client_wants_usage:
        # Token counts for the metrics; the extra usage chunk is removed before it reaches the client.
        # Never on a non-streaming request: vLLM answers 400 to stream_options without stream.
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        plan.usage_injected = True
    return plan


def _budget(body: dict[str, Any], preset: Preset, plan: Plan, spec: Endpoint) -> None:
    # A runaway brake, not a throttle: thinking models charge 100-800 reasoning tokens to this
    # budget, so max_tokens=200 returns HTTP 200 with empty content.
    keys = spec.dialect.token_keys
    key = next((k for k in keys if body.get(k) is not None), None)
    if key is None:
        key = spec.dialect.default_budget_key(spec.name)
        body[key] = preset.max_tokens
        plan.notes.append(("max_tokens_set", f"{key}={preset.max_tokens}"))
        return
    value = body[key]
    # The floor only protects a budget that thinking would eat: a request that does not think
    # (thinking off, or an endpoint without a chat template) keeps its own small max_tokens.
    thinks = spec.thinks and spec.dialect.thinks(body)
    if thinks and preset.min_max_tokens and value < preset.min_max_tokens:
        body[key] = preset.min_max_tokens
        plan.notes.append(("max_tokens_raised", f"{key}={value}->{preset.min_max_tokens}"))


def _params(body: dict[str, Any], preset: Preset, plan: Plan) -> None:
    filled = [name for name in preset.params if name not in body]
    for name in filled:
        body[name] = preset.params[name]
    if filled:
        plan.notes.append(("params", "params=" + "+".join(filled)))


def budget_key(body: dict[str, Any], endpoint: Endpoint) -> str | None:
    return next((k for k in endpoint.dialect.token_keys if body.get(k) is not None), None)


def cap_to_context(
    body: dict[str, Any], context: int | None, endpoint: Endpoint | str = "chat"
) -> tuple[dict[str, Any], Note | None]:
    """Per replica: vLLM rejects a token budget above max_model_len with a 400."""
    spec = _endpoint(endpoint)
    if not context or not spec.budget:
        return body, None
    key = budget_key(body, spec)
    if key is None or body[key] <= context:
        return body, None
    capped = {**body, key: context}
    return capped, ("max_tokens_capped", f"{key}={body[key]}->{context}")
