"""A streamed chat request classed by how it ended, and the routing table for replicas that are
killed under load: shared by tests/real/test_resilience_real.py and bench/killcut.py."""

from __future__ import annotations

from collections.abc import Sequence

import httpx2
import orjson

CHAT = "/v1/chat/completions"


def kill_routes(urls: Sequence[str]) -> str:
    listing = ", ".join(f'{{name: r{i}, url: "{url}", engine: llamacpp}}' for i, url in enumerate(urls))
    return f"""
defaults: {{min_max_tokens: 0, timeouts: {{connect: 2, first_byte: 30, idle: 10, read: 60}}}}
health: {{interval: 1, timeout: 1}}
presets:
  m: {{served_model: tiny, replicas: [{listing}]}}
routing: {{default: m}}
"""


def stream_once(url: str, max_tokens: int) -> str:
    """One streamed request: done | error_event | truncated[: why] | failed_before_bytes[: why]."""
    body = {
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # the random model would stop at random; these streams must last
    }
    last = ""
    try:
        with httpx2.stream("POST", url + CHAT, json=body, timeout=60) as response:
            if response.status_code != 200:
                response.read()
                return f"failed_before_bytes: {response.status_code}"
            for line in response.iter_lines():
                if line.startswith("data:"):
                    last = line
    except httpx2.HTTPError as exc:
        # The connection broke: what the stream said last still tells how it ended.
        if not last:
            return f"failed_before_bytes: {type(exc).__name__}"
        return _ending(last) if _ending(last) != "truncated" else f"truncated: {type(exc).__name__}"
    return _ending(last) if last else "truncated: no data event"


def _ending(last: str) -> str:
    if last == "data: [DONE]":
        return "done"
    if last.startswith("data: {") and "error" in orjson.loads(last[6:]):
        return "error_event"
    return "truncated"
