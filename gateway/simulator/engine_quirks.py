"""Engine behaviours a simulated replica copies when told to, so a test can show what the gateway's
fixes change: both are off by default, and every other behaviour of the simulator stays as it is.

- `refuse_schema_keywords`: a tool whose JSON Schema holds one of these keywords anywhere fails the
  request the way the engine fails a grammar it cannot build: llama-server's 400 "Failed to
  initialize samplers: failed to parse grammar" for any tool, vLLM's 400 "Invalid grammar
  specification: 'triggers'" for a tool with `strict: true` only (it compiles no other).
- `drop_tool_images`: image parts inside a tool result vanish before the prompt is rendered, as a
  chat template that renders a tool message's text only drops them, without an error.

Every dialect reaches here as a chat request (messages.py, responses.py), so a tool is
`{"type": "function", "function": {...}}` and a tool result a `role: tool` message.
"""

from __future__ import annotations

from typing import Any

from gateway.types import Json

LLAMA_REFUSAL = "Failed to initialize samplers: failed to parse grammar"
VLLM_REFUSAL = "Invalid grammar specification: 'triggers'"
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
_MAX_NODES = 10_000


_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _keywords(node: Any, found: set[str], budget: list[int]) -> None:
    """Every keyword of a schema and of the schemas inside it, bounded; the keys of `properties`
    and the like are names, not keywords, so only the schemas under them are read."""
    if budget[0] <= 0:
        return
    budget[0] -= 1
    if isinstance(node, list):
        for value in node:
            _keywords(value, found, budget)
        return
    if not isinstance(node, dict):
        return
    found.update(node)
    for key, value in node.items():
        if key in _NAMED and isinstance(value, dict):
            for sub in value.values():
                _keywords(sub, found, budget)
        elif isinstance(value, dict | list):
            _keywords(value, found, budget)


def refused_schema(engine: str, refuse: tuple[str, ...], tools: list[Any]) -> str | None:
    """The engine's refusal message when a tool's schema holds a refused keyword, else None."""
    if not refuse:
        return None
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            continue
        if engine == "vllm" and function.get("strict") is not True:
            continue
        found: set[str] = set()
        _keywords(function.get("parameters"), found, [_MAX_NODES])
        if found & set(refuse):
            return VLLM_REFUSAL if engine == "vllm" else LLAMA_REFUSAL
    return None


def without_tool_images(messages: list[Json]) -> list[Json]:
    """The messages with the image parts of every tool result removed (the rest as it came)."""
    out: list[Json] = []
    for message in messages:
        content = message.get("content")
        if message.get("role") == "tool" and isinstance(content, list):
            kept = [p for p in content if not (isinstance(p, dict) and p.get("type") in IMAGE_PARTS)]
            if len(kept) != len(content):
                message = {**message, "content": kept}
        out.append(message)
    return out
