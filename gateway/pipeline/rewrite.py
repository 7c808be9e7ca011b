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

from gateway.answers.changes import Changes
from gateway.answers.context_stop import ContextStop
from gateway.dialects import tool_schemas
from gateway.dialects.base import Note
from gateway.dialects.openai import OPENAI
from gateway.dialects.registry import BY_NAME, Endpoint
from gateway.errors import BadRequest, ContextExceeded
from gateway.pipeline.walk import ToolsJson
from gateway.routing.table import Preset

# Fields some proxies accept to pick an upstream: a body must never choose where it is sent.
UPSTREAM_FIELDS = ("api_base", "base_url", "api_key", "extra_headers", "url", "custom_llm_provider")
GATEWAY_FIELDS = ("task",)


@dataclass
class Plan:
    """What the rewrite decided, and the body to send: a copy of the client's top level with the
    owned keys changed (nested values are shared until a rule replaces them), so the parsed request
    stays as sent and a fallback to another preset starts again from it."""

    stream: bool
    client_wants_usage: bool
    body: dict[str, Any] = field(default_factory=dict)
    usage_injected: bool = False
    budget_explicit: bool = False  # the client set its own token budget
    notes: list[Note] = field(default_factory=list)
    loosened: bool = False  # the tool schemas were sent once more without constraints (tool_schemas)
    changes: Changes = field(default_factory=Changes)  # to the answer, by what was changed here
    # Messages: a stop on a budget lowered to the context's room is said as a full context.
    context_stop: ContextStop | None = None


def _endpoint(endpoint: Endpoint | str) -> Endpoint:
    return BY_NAME[endpoint] if isinstance(endpoint, str) else endpoint


def check_request(body: dict[str, Any], endpoint: Endpoint | str, odd_types: bool = True) -> None:
    """Reject what no backend can serve before any replica is bothered with it. `odd_types` False:
    the body's walk saw no `type` that is not a string or null, so the parts' types go unread."""
    spec = _endpoint(endpoint)
    for name in UPSTREAM_FIELDS:
        if name in body:
            raise BadRequest(
                f"The field '{name}' is not accepted: the gateway chooses the upstream", param=name
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    spec.validate(body, odd_types)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    if spec.budget:
        for key in spec.dialect.token_keys:
            value = body.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise BadRequest(f"'{key}' must be a positive integer", param=key)


def rewrite(
    request: dict[str, Any],
    preset: Preset,
    endpoint: Endpoint | str,
    *,
    want_usage: bool,
    schemas: tool_schemas.CleanLists | None = None,
    tools_json: ToolsJson | None = None,
) -> Plan:
    """Apply the preset to a checked body; `request` itself is left as it is (copy-on-write).
    Idempotent: a second pass changes nothing. `schemas`: the request path's tool lists known to
    need no fix (the same plan with or without them); `tools_json`: the parsed list's JSON."""
    spec = _endpoint(endpoint)
    dialect = spec.dialect
    body = dict(request)
    stream = spec.streams and body.get("stream") is True
    options = body.get("stream_options")
    client_wants_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    plan = Plan(stream=stream, client_wants_usage=client_wants_usage, body=body)
    for name in GATEWAY_FIELDS:
        body.pop(name, None)
    # vLLM answers 404 to any name but its --served-model-name; llama-server ignores it.
    body["model"] = preset.served_model
    plan.notes += dialect.fixes(body, preset.compat, plan.changes)
    if "tool_schemas" in preset.compat:
        listed = tools_json.of(body.get("tools")) if tools_json is not None else None
        plan.notes += tool_schemas.fix(body, preset.engines, schemas, listed)
    if spec.thinks:
        plan.notes += dialect.thinking(body, preset.thinking, preset.thinking_override)
    if spec.budget:
        _budget(body, preset, plan, spec)
        _params(body, preset, plan)
        if spec.name == "messages":
            plan.context_stop = ContextStop()
            plan.changes.add(plan.context_stop)
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
    plan.budget_explicit = key is not None
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


def least_room(context: int) -> int:
    """The fewest tokens worth answering in: below this, the prompt has filled the context."""
    return min(1024, context // 4)


def cap_to_context(
    body: dict[str, Any],
    context: int | None,
    endpoint: Endpoint | str = "chat",
    prompt_tokens: int | None = None,
    explicit: bool = True,
) -> tuple[dict[str, Any], Note | None]:
    """Per replica: the budget lowered to what the context leaves after the prompt, never raised.
    vLLM refuses a budget above max_model_len (and older builds one past what the prompt leaves);
    llama-server stops at a full context with a `length` that reads as a spent budget. A prompt
    that leaves less than `least_room` is refused here in the agents' own terms: past the context,
    or (for a budget the client chose) the budget that does not fit."""
    spec = _endpoint(endpoint)
    if not context or not spec.budget:
        return body, None
    key = budget_key(body, spec)
    if key is None:
        return body, None
    budget = body[key]
    room = context if prompt_tokens is None else context - prompt_tokens
    if prompt_tokens is not None and room < least_room(context):
        if explicit and prompt_tokens < context:
            raise ContextExceeded(
                f"The prompt ({prompt_tokens} tokens) and the budget ({budget}) exceed the context of "
                f"{context} tokens",
                prompt_tokens=prompt_tokens,
                context=context,
                budget=budget,
            )
        raise ContextExceeded(
            f"The prompt ({prompt_tokens} tokens) leaves less than {least_room(context)} of the context's "
            f"{context} tokens to answer in",
            prompt_tokens=prompt_tokens,
            context=context - least_room(context),
        )
    if budget <= room:
        return body, None
    return {**body, key: room}, ("max_tokens_capped", f"{key}={budget}->{room}")
