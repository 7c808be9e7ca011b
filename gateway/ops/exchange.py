"""One request's record, filled in as it moves along the request path and read once at the end.

Metrics, the access log, the status page and the key's usage all read this record, so they cannot
disagree. It records what happened; it decides nothing: whether the status line went out is known
by the request's `Responder` (relay/respond.py), which writes `status` here when it does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.dialects.answer import Answer
from gateway.fleet.stored import NOBODY, Owner
from gateway.team.keys import OPEN, Identity
from gateway.team.limits import Usage
from gateway.team.windows import Reservation

Outcome = Literal["completed", "rejected", "client_disconnected", "upstream_error"]


@dataclass(slots=True)
class Exchange:
    """What one request was, met and became (see the module docstring)."""

    request_id: str
    endpoint: str
    started: float
    tool: str = ""  # the MCP tool a request ran for (endpoint "mcp")
    client: str = ""
    preset: str = "unknown"
    route: str = ""
    replica: str = ""
    engine: str = ""
    stream: bool = False
    upstream_stream: bool = False  # the replica was asked for a stream (also for some whole answers)
    upstream_as_chat: bool = False  # a Messages request sent as chat, to pin its slot (messages_chat.py)
    status: int = 0  # what went out to the client; 0 while nothing did
    outcome: Outcome = "completed"
    error_code: str | None = None
    key_limit: str | None = None  # the key's limit that refused it (errors.GatewayError.key_limit)
    disconnect_phase: str | None = None
    rewrites: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (kind, message)
    attempts: int = 0
    retries: list[str] = field(default_factory=list)
    upstream_errors: list[str] = field(default_factory=list)
    failed_replica: str = ""
    ejected: list[str] = field(default_factory=list)
    path: list[str] = field(
        default_factory=list
    )  # "replica:outcome" per attempt, for the access log  # replicas this request's failures took out
    pick_reason: str = ""
    prefix: str = ""  # the prefix fingerprint
    prefix_found: list[str] = field(default_factory=list)  # kinds of volatile content
    prefix_churn: bool = False
    client_id: str = ""
    upstream_sent: float | None = None
    load_wait: float | None = None  # seconds spent waiting for a launched replica to start
    first_token: float | None = None
    finished: float | None = None
    answer: Answer = field(default_factory=Answer)
    prompt: Any = None  # only with GATEWAY_LOG_PROMPTS
    identity: Identity = OPEN  # the key's name, priority, presets and limits (never the key)
    owner: Owner = NOBODY  # whose the state this request makes the gateway keep is (stored answers)
    priority: str = "interactive"
    admitted: bool = False  # past the key's limits: its tokens are charged to the key
    reservation: Reservation | None = None  # the tokens reserved at admission, settled by the charge
    estimated_tokens: int = 0  # the prompt, estimated from the body's text
    counted_tokens: int | None = None  # ... and as the engine counted it, where it was near the context
    fallback: str = ""  # "dense->moe (down)": the x-gateway-fallback header
    fallback_reason: str = ""
    fallback_from: str = ""  # the preset asked for, when a fallback served
    queue_wait: float | None = None  # seconds in the preset's queue for a free place

    def charged(self) -> Usage:
        """What the key is charged for this request: the engine's own figures when the answer
        reported them; for an answer cut short (a client that left, a replica that broke off), the
        prompt as estimated or announced and the events relayed so far, one token each (engines
        stream about a token per event); nothing when no replica was reached."""
        answer = self.answer
        if answer.completion_tokens is not None:
            return Usage(
                answer.prompt_tokens or 0,
                answer.cached_tokens or 0,
                answer.completion_tokens,
                answer.reasoning_tokens or 0,
            )
        if not self.attempts:
            return Usage()
        prompt = answer.prompt_tokens or self.estimated_tokens
        return Usage(prompt, answer.cached_tokens or 0, answer.events, 0)

    @property
    def key(self) -> str:
        return self.identity.name

    @property
    def status_class(self) -> str:
        if self.outcome == "client_disconnected" and not self.status:
            return "499"
        return f"{self.status // 100}xx" if self.status else "none"
