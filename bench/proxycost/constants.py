"""Paths and figures that more than one of the benchmark's modules needs."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent  # bench/: results/ lives here
ROOT = BENCH.parent
DEFAULT_OUT = BENCH / "results" / "gateway.jsonl"
CHAT = "/v1/chat/completions"
CHUNKS = 64  # SSE chunks per stream from the instant upstream
MAX_BODY = 32 * 1024 * 1024  # the gateway's shipped GATEWAY_MAX_BODY_BYTES
