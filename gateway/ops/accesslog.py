"""Structured access log: one JSON line per request on stdout.

What is logged is what the record holds: ids, names, numbers and outcomes. Prompt and completion
text, keys and replica URLs never enter the record, so they cannot leak through here.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import IO, Any

import orjson

from gateway.ops.exchange import Exchange


def _ms(start: float, end: float | None) -> float | None:
    # Rounded as a whole number of microseconds: round() with digits converts through decimal
    # text, about four times the cost, on every request's three to five times.
    return None if end is None else round((end - start) * 1e6) / 1000


def _upstream(ex: Exchange) -> str | None:
    """How the replica was asked: `stream` or `whole`, and `chat-stream` for a Messages request
    sent as chat to pin its slot."""
    if not ex.attempts:
        return None
    if ex.upstream_as_chat:
        return "chat-stream"
    return "stream" if ex.upstream_stream else "whole"


def entry(ex: Exchange) -> dict[str, Any]:
    answer = ex.answer
    line = {
        "ts": round(time.time() * 1000) / 1000,
        "request_id": ex.request_id,
        "endpoint": ex.endpoint,
        "tool": ex.tool or None,
        "client": ex.client,
        "preset": ex.preset,
        "route": ex.route or None,
        "replica": ex.replica or None,
        "engine": ex.engine or None,
        "stream": ex.stream,
        "upstream": _upstream(ex),
        "status": ex.status if ex.status or ex.outcome != "client_disconnected" else 499,
        "outcome": ex.outcome,
        "error_code": ex.error_code,
        "disconnect_phase": ex.disconnect_phase,
        "rewrites": [text for _, text in ex.rewrites],
        "warnings": [message for _, message in ex.warnings],
        "attempts": ex.attempts,
        "retries": ex.retries,
        "path": ex.path or None,
        "pick": ex.pick_reason or None,
        "prefix": ex.prefix or None,
        "prefix_volatile": ex.prefix_found or None,
        "prefix_churn": ex.prefix_churn,
        "client_id": ex.client_id,
        "key": ex.key,
        "priority": ex.priority,
        "fallback": ex.fallback or None,
        "queue_wait_ms": None if ex.queue_wait is None else round(ex.queue_wait * 1e6) / 1000,
        "duration_ms": _ms(ex.started, ex.finished),
        "overhead_ms": _ms(ex.started, ex.upstream_sent),
        "load_wait_ms": None if ex.load_wait is None else round(ex.load_wait * 1000, 1),
        "ttft_ms": _ms(ex.started, ex.first_token),
        "estimated_tokens": ex.estimated_tokens or None,  # the prompt, by the gateway's estimate
        "counted_tokens": ex.counted_tokens,  # ... and by the engine's count, where it was near the context
        "prompt_tokens": answer.prompt_tokens,
        "cached_tokens": answer.cached_tokens,
        "completion_tokens": answer.completion_tokens,
        "reasoning_tokens": answer.reasoning_tokens,
        "finish_reason": answer.finish_reason,
    }
    if ex.prompt is not None:
        line["prompt"] = ex.prompt
    return line


class AccessLog:
    """Lines are written at once, flushed together within `flush_interval` seconds: a write per
    request costs a system call, and a slow reader of stdout (a log shipper) must not hold up the
    event loop once per request."""

    def __init__(
        self, stream: IO[bytes] | None = None, enabled: bool = True, flush_interval: float = 0.0
    ) -> None:
        self._stream = stream if stream is not None else sys.stdout.buffer
        self.enabled = enabled
        self.flush_interval = flush_interval
        self._pending: list[bytes] = []
        self._scheduled = False

    def write(self, ex: Exchange) -> None:
        if not self.enabled:
            return
        self._pending.append(orjson.dumps(entry(ex)))
        if self.flush_interval <= 0 or len(self._pending) >= 256:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_later(self.flush_interval, self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._pending:
            lines, self._pending = self._pending, []
            self._stream.write(b"\n".join(lines) + b"\n")
            self._stream.flush()
