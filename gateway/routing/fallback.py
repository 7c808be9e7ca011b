"""Fallbacks between presets: when a preset cannot serve a request, which one does (pure).

A preset lists `fallback: [moe, small]`. The first of them that can serve takes the request when
the preset has no available replica (`down`), its launched replicas failed (`failed`), a load
would outlast the client's patience (`loading`), its queue is full (`full`), or the prompt is
longer than its context (`context`). A target must be able to serve now: a replica available with
a free place or room in the queue; for `context`, one that fits the prompt may also load first.
The request path (pipeline/fallback.py) reads the pools and the supervisor into `Standing` values;
everything here is values.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.errors import FallbackReason as Reason
from gateway.types import ReadBytes

REASONS: tuple[Reason, ...] = ("down", "failed", "loading", "full", "context")
# The engines' own words for a prompt past the context (vLLM, llama-server's error type and text).
_CONTEXT_ERROR = re.compile(
    rb"maximum context length|exceed_context_size_error|exceeds the available context size"
)


@dataclass(frozen=True)
class Standing:
    """What a preset can do for a request now."""

    available: bool  # some replica is healthy (or panic-routable) and not a stopped launched one
    free: bool  # one of those has a free place or the queue has room
    failed: bool = False  # every launched replica is failed
    loadable: bool = False  # every replica is launched and none serves yet: a request starts one
    expected_load: float | None = None  # the last load's seconds, when one was measured
    context: int | None = None  # the smallest context among its replicas, where known


def why_not(standing: Standing, prompt_tokens: int | None, patience: float) -> Reason | None:
    """Why this preset should hand the request on, or None when it should serve it."""
    if prompt_tokens is not None and standing.context is not None and prompt_tokens > standing.context:
        return "context"
    if standing.failed:
        return "failed"
    if standing.loadable:
        # Unknown load time: start it and wait; the wait running out falls back (at `loading`).
        if standing.expected_load is not None and standing.expected_load > patience:
            return "loading"
        return None
    if not standing.available:
        return "down"
    if not standing.free:
        return "full"
    return None


def can_take(standing: Standing, reason: Reason, prompt_tokens: int | None) -> bool:
    """Whether a fallback target can serve the request that `reason` moved off its preset."""
    if prompt_tokens is not None and standing.context is not None and prompt_tokens > standing.context:
        return False
    if standing.failed:
        return False
    if reason == "context" and standing.loadable:
        return True  # a longer context is worth a load; the other reasons want an answer now
    return standing.available and standing.free and not standing.loadable


def choose(
    candidates: Sequence[tuple[str, Standing]],
    reason: Reason,
    prompt_tokens: int | None,
    skip: Sequence[str] = (),
) -> str | None:
    """The first fallback that can take the request, skipping presets already tried."""
    for name, standing in candidates:
        if name not in skip and can_take(standing, reason, prompt_tokens):
            return name
    return None


def context_error(status: int, body: ReadBytes) -> bool:
    """An engine's refusal of a prompt longer than its context."""
    return status == 400 and _CONTEXT_ERROR.search(body[:65536]) is not None


# The engines' numbers in those refusals: vLLM's sentence, llama-server's fields (docs/engines.md).
_VLLM_NUMBERS = re.compile(rb"maximum context length is (\d+) tokens.{0,200}?(\d+) input tokens", re.S)
_LLAMA_PROMPT = re.compile(rb'"n_prompt_tokens"\s*:\s*(\d+)')
_LLAMA_CONTEXT = re.compile(rb'"n_ctx"\s*:\s*(\d+)')


def context_numbers(body: ReadBytes) -> tuple[int, int] | None:
    """(prompt tokens, context) as an engine's context refusal counts them, where it says both."""
    head = body[:65536]
    found = _VLLM_NUMBERS.search(head)
    if found is not None:
        return int(found.group(2)), int(found.group(1))
    prompt, context = _LLAMA_PROMPT.search(head), _LLAMA_CONTEXT.search(head)
    if prompt is not None and context is not None:
        return int(prompt.group(1)), int(context.group(1))
    return None


def header_value(preset: str, target: str, reason: Reason) -> str:
    return f"{preset}->{target} ({reason})"
