"""A Messages answer cut short by a full context, said in Anthropic's terms.

When the gateway lowered the budget to what the replica's context leaves after the prompt
(pipeline/rewrite.py `cap_to_context`), an answer that then stops on its budget stopped because the
context is full, not because the client's output limit was reached. Claude Code (2.1.332) tells
the two apart by `stop_reason`: `max_tokens` is its output limit, `model_context_window_exceeded`
the model's window (its stop-reason list and diagnostics name both). The change is armed only for
an attempt whose budget was lowered that way; otherwise it is done and no event is parsed for it.
"""

from __future__ import annotations

from typing import Any

from gateway.answers.changes import Change
from gateway.answers.events import Event

CONTEXT_FULL = "model_context_window_exceeded"


class ContextStop(Change):
    """`stop_reason: max_tokens` becomes `model_context_window_exceeded` while armed."""

    name = "context_stop"
    markers: tuple[bytes, ...] | None = (b'"max_tokens"',)

    def __init__(self) -> None:
        self.done = True  # until an attempt's budget is lowered to the context's room

    def arm(self, capped: bool) -> None:
        """Set per attempt, before it is sent: whether its budget was lowered to the context."""
        self.done = not capped

    def stream(self, event: Event) -> list[Event]:
        # Other changes may have the relay parse every event: unarmed, this one leaves them be.
        data = None if self.done else event.data
        if data is not None and data.get("type") == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason") == "max_tokens":
                event.data = {**data, "delta": {**delta, "stop_reason": CONTEXT_FULL}}
                event.changed()
        return [event]

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        if not self.done and payload.get("stop_reason") == "max_tokens":
            return {**payload, "stop_reason": CONTEXT_FULL}
        return payload
