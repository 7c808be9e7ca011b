"""One request's record, filled in as it moves along the request path and read once at the end.

Metrics, the access log and the status page all read this record, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.dialects.answer import Answer
from gateway.team.keys import OPEN, Identity

Outcome = Literal["completed", "rejected", "client_disconnected", "upstream_error"]


@dataclass(slots=True)
class Exchange:
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
    status: int = 0
    outcome: Outcome = "completed"
    error_code: str | None = None
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
    headers_sent: bool = False
    # The gateway opened the SSE stream itself (loading comments) before any replica answered:
    # a failure from here on is an error event, not an error response.
    stream_opened: bool = False
    identity: Identity = OPEN  # the key's name, priority, presets and limits (never the key)
    priority: str = "interactive"
    admitted: bool = False  # past the key's limits: its tokens are charged to the key
    fallback: str = ""  # "dense->moe (down)": the x-gateway-fallback header
    fallback_reason: str = ""
    fallback_from: str = ""  # the preset asked for, when a fallback served
    queue_wait: float | None = None  # seconds in the preset's queue for a free place

    @property
    def key(self) -> str:
        return self.identity.name

    @property
    def status_class(self) -> str:
        if self.outcome == "client_disconnected" and not self.headers_sent:
            return "499"
        return f"{self.status // 100}xx" if self.status else "none"
