"""The values the team's counters trade in: a key's limits, a refusal, one answer's tokens.

Pure data, shared by the local counters (windows.py), the Redis-backed ones (state.py) and the
request path, so that each speaks about a limit in the same words.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, NamedTuple

RateLimit = Literal["requests_per_minute", "tokens_per_minute", "tokens_per_day"]
MINUTE = 60.0
DAY = 86400.0
WINDOW: dict[RateLimit, float] = {
    "requests_per_minute": MINUTE,
    "tokens_per_minute": MINUTE,
    "tokens_per_day": DAY,
}


@dataclass(frozen=True)
class KeyLimits:
    """None: no limit. Windows slide: a request counts for the 60 s (or 24 h) after it."""

    concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None

    # Read on every request of the key: worked out once per key (a frozen dataclass keeps them
    # in its __dict__, which `cached_property` writes directly).
    @functools.cached_property
    def counted(self) -> bool:
        """Whether any window counts for this key (a key without limits costs no bookkeeping)."""
        return self.requests_per_minute is not None or self.tokens

    @functools.cached_property
    def tokens(self) -> bool:
        """Whether a token window counts for this key."""
        return self.tokens_per_minute is not None or self.tokens_per_day is not None

    @functools.cached_property
    def rates(self) -> tuple[tuple[RateLimit, int], ...]:
        """The key's rate limits, each with its allowance, the shortest window first."""
        return tuple(
            (name, value)
            for name in ("requests_per_minute", "tokens_per_minute", "tokens_per_day")
            if (value := getattr(self, name)) is not None
        )


@dataclass(frozen=True, slots=True)
class Denial:
    """Why a key's request is refused now, and when the window admits one again."""

    limit: RateLimit
    allowed: int
    used: int
    retry_after: float  # seconds, > 0

    def message(self, key: str) -> str:
        unit = "requests" if self.limit == "requests_per_minute" else "tokens"
        window = "24 h" if self.limit == "tokens_per_day" else "60 s"
        return (
            f"Key '{key}' is over its limit {self.limit}={self.allowed}: {self.used} {unit} in the last "
            f"{window}; retry after {max(1, round(self.retry_after))} s"
        )


class Usage(NamedTuple):
    """One answer's tokens as the engine reported them (prompt includes cached). A named tuple: one
    is made at the end of every request, and a frozen dataclass sets each field through
    `object.__setattr__` (0.78 us a construction with slots, 1.67 without, 0.47 for this)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def charged(self) -> int:
        """What token limits count: prompt + completion."""
        return self.prompt_tokens + self.completion_tokens


# A key's day of usage, per preset: its requests, and each of an answer's counts under its own name.
USAGE_FIELDS = ("requests", *Usage._fields)
