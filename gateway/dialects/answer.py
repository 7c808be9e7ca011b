"""What a replica's answer says about itself: token counts, cache hits, finish reason, the thinking trap.

Both dialects in one place: vLLM reports reasoning in `reasoning`, llama-server in
`reasoning_content`; cached prompt tokens come from `usage.prompt_tokens_details.cached_tokens`
(vLLM only with --enable-prompt-tokens-details) or llama-server's `timings.cache_n`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REASONING_KEYS = ("reasoning_content", "reasoning")
TRAP_WARNING = "reasoning consumed max_tokens"


@dataclass
class Answer:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    content_seen: bool = False
    reasoning_seen: bool = False

    @property
    def thinking_trap(self) -> bool:
        """HTTP 200 with nothing to show: reasoning spent the whole max_tokens budget."""
        reasoned = self.reasoning_seen or bool(self.reasoning_tokens)
        return self.finish_reason == "length" and not self.content_seen and reasoned

    def read_usage(self, payload: dict[str, Any]) -> None:
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = _int(usage.get("prompt_tokens"), self.prompt_tokens)
            self.completion_tokens = _int(usage.get("completion_tokens"), self.completion_tokens)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                self.cached_tokens = _int(details.get("cached_tokens"), self.cached_tokens)
            completion_details = usage.get("completion_tokens_details")
            if isinstance(completion_details, dict):
                self.reasoning_tokens = _int(
                    completion_details.get("reasoning_tokens"), self.reasoning_tokens
                )
        timings = payload.get("timings")
        if isinstance(timings, dict) and self.cached_tokens is None:
            self.cached_tokens = _int(timings.get("cache_n"), None)

    def read_message(self, payload: dict[str, Any]) -> None:
        """A non-streaming chat or completion response."""
        self.read_usage(payload)
        choices = payload.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        self.finish_reason = _str(choice.get("finish_reason"), self.finish_reason)
        message = choice.get("message")
        if isinstance(message, dict):
            self._read_delta(message)
        elif isinstance(choice.get("text"), str) and choice["text"]:
            self.content_seen = True

    def read_chunk(self, payload: dict[str, Any]) -> None:
        """One streamed chunk (only those worth parsing reach here)."""
        self.read_usage(payload)
        choices = payload.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            self.finish_reason = _str(choice.get("finish_reason"), self.finish_reason)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._read_delta(delta)
            elif isinstance(choice.get("text"), str) and choice["text"]:
                self.content_seen = True

    def _read_delta(self, message: dict[str, Any]) -> None:
        content = message.get("content")
        if (isinstance(content, str) and content) or message.get("tool_calls"):
            self.content_seen = True
        if any(isinstance(message.get(k), str) and message[k] for k in REASONING_KEYS):
            self.reasoning_seen = True


def _int(value: Any, fallback: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else fallback


def _str(value: Any, fallback: str | None) -> str | None:
    return value if isinstance(value, str) else fallback
