"""The routes table every gateway contender runs with, whatever its revision: one preset in front of
the instant upstream, one in front of the holding upstream, the shipped routes.yaml's defaults, and
(`--with-team`) one named key with every limit set."""

from __future__ import annotations

import hashlib
import json
from typing import Any

# The `defaults:` and `health:` blocks of the shipped routes.yaml, so that every gateway, whatever
# its own built-in defaults, runs with every feature that file turns on (tests/bench/test_bench.py
# checks that they stay the same), but for the admission limit (1,000 open streams need more than
# 64 in flight per replica) and `compat`, whose fix names older revisions do not all know; the fixes
# act on tools and on Messages and Responses fields, none of which the benchmark's chat requests carry.
SHIPPED_DEFAULTS: dict[str, Any] = {
    "thinking": False,
    "max_tokens": 8192,
    "min_max_tokens": 1024,
    "policy": "round_robin",
    "timeouts": {"connect": 5, "first_byte": 60, "idle": 120, "read": 1800},
    "limits": {"max_in_flight": 64, "queue": 32, "queue_timeout": 30},
    "retries": {"attempts": 3},
    "prefix": {"volatile": "warn"},
}
SHIPPED_HEALTH: dict[str, Any] = {
    "interval": 5,
    "timeout": 2,
    "healthy_threshold": 2,
    "unhealthy_threshold": 3,
    "eject_after": 3,
    "eject_base": 30,
    "eject_max": 300,
}
MAX_IN_FLIGHT = 1100

# `--with-team`: one named key, sent by every client of that contender, with every limit set (and
# so every counter kept, in the process) but too high to refuse anything a run sends: 1,000 open
# streams, a few hundred thousand requests a minute.
TEAM_KEY = "bench-team-key"  # not a secret: a benchmark's key on 127.0.0.1
TEAM_LIMITS = {
    "concurrent": 2048,
    "requests_per_minute": 10_000_000,
    "tokens_per_minute": 1_000_000_000,
    "tokens_per_day": 1_000_000_000_000,
}


def routes_yaml(upstream: int, hold: int, team: bool = False) -> str:
    """One preset in front of the instant upstream and one (`hold`) in front of the holding upstream,
    for the open-streams memory test; `vision: true` lets the image bodies through. JSON, which is
    YAML: every revision's loader reads it."""
    defaults = {**SHIPPED_DEFAULTS, "limits": {**SHIPPED_DEFAULTS["limits"], "max_in_flight": MAX_IN_FLIGHT}}
    table: dict[str, Any] = {
        "defaults": defaults,
        "health": SHIPPED_HEALTH,
        "presets": {
            "bench": {
                "served_model": "m",
                "vision": True,
                "replicas": [{"name": "instant", "url": f"http://127.0.0.1:{upstream}", "engine": "vllm"}],
            },
            "hold": {
                "served_model": "m",
                "replicas": [{"name": "held", "url": f"http://127.0.0.1:{hold}", "engine": "vllm"}],
            },
        },
        "routing": {"default": "bench"},
    }
    if team:
        digest = hashlib.sha256(TEAM_KEY.encode()).hexdigest()
        key = {"name": "bench", "key_sha256": digest, "presets": ["bench", "hold"], "limits": TEAM_LIMITS}
        table["keys"] = [key]
    return json.dumps(table, indent=1) + "\n"
