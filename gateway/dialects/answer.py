"""What a replica's answer says about itself, whatever its wire format: token counts, cache hits,
the finish reason, and the thinking trap.

Each dialect module reads its own shapes into this one record (`openai.py`, `anthropic.py`,
`responses.py`); metrics, the access log and the status page read only the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRAP_WARNING = "reasoning consumed max_tokens"


@dataclass
class Answer:
    """What one answer reported about itself, filled by a dialect's `read_whole` or `read_event` and
    read by metrics, the access log, the status page and usage charging; a count stays None where
    the replica did not report it."""

    prompt_tokens: int | None = None  # every prompt token, cached ones included
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None
    # Normalised: "length" whenever the token budget ended the answer, in every dialect.
    finish_reason: str | None = None
    content_seen: bool = False
    reasoning_seen: bool = False
    response_id: str | None = None  # a stored Responses answer: later calls about it go to its replica
    events: int = 0  # stream events relayed: what a stream cut before its usage is charged for

    @property
    def thinking_trap(self) -> bool:
        """HTTP 200 with nothing to show: reasoning spent the whole token budget."""
        reasoned = self.reasoning_seen or bool(self.reasoning_tokens)
        return self.finish_reason == "length" and not self.content_seen and reasoned


def as_int(value: Any, fallback: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else fallback


def as_str(value: Any, fallback: str | None) -> str | None:
    return value if isinstance(value, str) else fallback
