"""What the simulated model generates for one request (engine.py makes it, misbehave.py may break
its tool call, the dialects write it out)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.types import Json


@dataclass(frozen=True)
class Output:
    """What the simulated model generates for one request: reasoning and content tokens, a tool
    call, the finish reason, and whether the answer began before the budget ran out."""

    reasoning: tuple[str, ...]
    content: tuple[str, ...]
    tool_call: Json | None
    tool_tokens: int
    finish_reason: str
    answered: bool  # False when the budget ran out before the answer (content is then empty/null)

    @property
    def completion_tokens(self) -> int:
        return len(self.reasoning) + len(self.content) + self.tool_tokens

    def text(self) -> str:
        return " ".join((*self.reasoning, *self.content))
