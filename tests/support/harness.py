"""Start the gateway for a test: a routing table given as YAML text, settings as keywords.

The gateway runs under uvicorn with httptools (as in production) on 127.0.0.1 in a background
thread (bench/support/gateway.py, shared with the benchmarks); the test talks to it over a real
socket.
"""

from __future__ import annotations

from typing import Any

from bench.support.gateway import Running, run_gateway

__all__ = ["Running", "eventually", "one_replica_table", "run_gateway"]


def one_replica_table(url: str, engine: str = "vllm", extra: str = "") -> str:
    return f"""
presets:
  m:
    served_model: m
    aliases: [alias-m]
    replicas: [{{name: r0, url: "{url}", engine: {engine}}}]
{extra}
routing: {{default: m}}
"""


def eventually(check: Any, timeout: float = 5.0, interval: float = 0.01) -> Any:
    """Poll `check()` until it returns something truthy (bounded); the gateway records a request just
    after its last byte is sent, so a client can be a moment ahead of the metrics and the log."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
