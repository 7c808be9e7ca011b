"""The last few minutes of traffic, for the status page: rates, TTFT percentiles, decode speed, cache hits.

Prometheus keeps the long history; this keeps a bounded window in memory so the page can say
"right now" without a Prometheus server. Fed from the same per-request record as the metrics and
the access log, so the three always agree.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from gateway.ops.exchange import Exchange

WINDOW = 300.0  # seconds of history behind every figure on the page
MAX_SAMPLES = 5000
MAX_WARNINGS = 50


class Sample(NamedTuple):
    """One finished request as the status page counts it: when (monotonic), its preset and replica,
    whether it succeeded, its time to first token, decode speed and prompt and cached tokens.
    A named tuple: made on every request, where a frozen dataclass costs three times as much."""

    at: float
    preset: str
    replica: str
    ok: bool
    ttft: float | None
    decode_tps: float | None
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Warning_:
    """One warning the status page lists: when (wall-clock), its kind, preset, replica and
    message."""

    at: float
    kind: str
    preset: str
    replica: str
    message: str


class Recent:
    """The last few minutes of traffic for the status page: at most `MAX_SAMPLES` samples, read over
    a `WINDOW`-second window, the latest `MAX_WARNINGS` warnings and a total count. Fed one record
    per request by the gateway's `record`."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self._clock = clock
        self._wall = wall
        self.samples: deque[Sample] = deque(maxlen=MAX_SAMPLES)
        self.warnings: deque[Warning_] = deque(maxlen=MAX_WARNINGS)
        self.total = 0

    def record(self, ex: Exchange) -> None:
        """Adds one finished request: a sample with its time to first token and decode speed (over
        the tokens after the first), and a warning for each it carried and for an upstream error."""
        self.total += 1
        answer = ex.answer
        decode = None
        tokens = answer.completion_tokens or 0
        if (
            ex.first_token is not None
            and ex.finished is not None
            and tokens > 1
            and ex.finished > ex.first_token
        ):
            decode = (tokens - 1) / (ex.finished - ex.first_token)
        self.samples.append(
            Sample(
                at=self._clock(),
                preset=ex.preset,
                replica=ex.replica,
                ok=ex.status < 500 and ex.outcome != "upstream_error",
                ttft=None if ex.first_token is None else ex.first_token - ex.started,
                decode_tps=decode,
                prompt_tokens=answer.prompt_tokens or 0,
                cached_tokens=answer.cached_tokens or 0,
            )
        )
        for kind, message in ex.warnings:
            self.warn(kind, ex, message)
        if ex.outcome == "upstream_error":
            self.warn("upstream_error", ex, f"{ex.error_code or 'error'} (request {ex.request_id})")

    def warn(self, kind: str, ex: Exchange, message: str) -> None:
        self.warnings.append(Warning_(self._wall(), kind, ex.preset, ex.replica, message))

    def window(self) -> list[Sample]:
        horizon = self._clock() - WINDOW
        return [s for s in self.samples if s.at >= horizon]

    def decode_speeds(self) -> dict[str, float]:
        """Mean decode tokens/s per preset over the window, where any answer measured it."""
        found: dict[str, list[float]] = {}
        for sample in self.window():
            if sample.decode_tps is not None:
                found.setdefault(sample.preset, []).append(sample.decode_tps)
        return {preset: round(sum(v) / len(v), 1) for preset, v in found.items()}


def summarise(samples: Iterable[Sample], seconds: float = 60.0, now: float | None = None) -> dict[str, Any]:
    """Figures over a set of samples: the rate is over the last `seconds`, the rest over all of them."""
    chosen = list(samples)
    latest = now if now is not None else max((s.at for s in chosen), default=0.0)
    ttfts = sorted(s.ttft for s in chosen if s.ttft is not None)
    decodes = [s.decode_tps for s in chosen if s.decode_tps is not None]
    prompt = sum(s.prompt_tokens for s in chosen)
    return {
        "requests": len(chosen),
        "rate_per_s": round(sum(1 for s in chosen if s.at >= latest - seconds) / seconds, 3),
        "error_ratio": round(sum(1 for s in chosen if not s.ok) / len(chosen), 4) if chosen else None,
        "ttft_p50_ms": _percentile_ms(ttfts, 0.50),
        "ttft_p95_ms": _percentile_ms(ttfts, 0.95),
        "decode_tps": round(sum(decodes) / len(decodes), 1) if decodes else None,
        "cache_hit_ratio": round(sum(s.cached_tokens for s in chosen) / prompt, 4) if prompt else None,
    }


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    index = min(len(ordered) - 1, int(q * len(ordered)))
    return round(ordered[index] * 1000, 1)
