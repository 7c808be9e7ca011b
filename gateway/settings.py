"""Process settings: where things are and how the process behaves, from `GATEWAY_*` variables.

What a request is routed to and how it is rewritten lives in routes.yaml (`table.py`); these are
the knobs of the process itself.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """The process's settings, read once at start from `GATEWAY_*` environment variables (unknown
    ones ignored): listen address, routes file, body, header and connection limits, stream timing,
    keys, browser and MCP limits, logging and the upstream client. The CLI overrides a few from its
    flags."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    routes: Path = Path("routes.yaml")
    host: str = "127.0.0.1"
    port: int = 18000
    # Image-bearing agent requests are large; the reference nginx set-up used 32 MiB.
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_json_depth: int = Field(64, ge=2)
    body_timeout: float = Field(30.0, gt=0)
    # httptools accepts headers of any size; Envoy's edge limits are 60 KiB and 100 fields.
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    max_header_count: int = Field(100, ge=8)
    # From a request's first byte to the end of its headers; a client that trickles them is cut off.
    header_timeout: float = Field(10.0, gt=0)
    # Open sockets beyond this are refused with a 503 before anything is read from them.
    max_connections: int = Field(4096, ge=1)
    # A streaming client that stops reading for this long is cut off, and so is its replica.
    write_timeout: float = Field(30.0, gt=0)
    # A streaming request that waits (queue, load, prefill) longer than this has its stream opened
    # by the gateway and kept alive every `keepalive_every` seconds (relay/keepalive.py).
    keepalive_after: float = Field(1.5, gt=0)
    # Below 10 s: Claude Code's shortest stream idle limit is 10 s, and a beat at that very interval
    # loses the race now and then (measured: a stream dropped and re-sent at 21.5 s).
    keepalive_every: float = Field(5.0, gt=0)
    # A replica's answer held in memory: one SSE event until its blank line, a whole non-streaming
    # answer. Past either, the client gets the error event (or a 502), not a gateway out of memory.
    max_event_bytes: int = Field(16 * 1024 * 1024, ge=4096)
    max_answer_bytes: int = Field(64 * 1024 * 1024, ge=4096)
    # Bodies above this are parsed and serialised on a worker thread so the event loop keeps serving.
    offload_bytes: int = Field(1024 * 1024, ge=0)
    # Comma-separated gateway keys; or a file with one key per line. None configured = open gateway.
    api_keys: str = ""
    api_keys_file: Path | None = None
    # Named keys with presets, priority and limits, as `keys:` in routes.yaml (gateway/team/keys.py).
    keys_file: Path | None = None
    # The plain keys above are not admins (no /admin/*, no other keys' figures) unless this is set;
    # a named key is one with `admin: true`. An open gateway's caller is its admin (edge/auth.py).
    anonymous_admin: bool = False
    # Comma-separated Host names served besides loopback ones (`*`: any); see gateway/edge/browser.py.
    allowed_hosts: str = ""
    # Comma-separated browser origins granted CORS (e.g. a web UI on another port); none by default.
    cors_origins: str = ""
    # /mcp: a body's size (the chat path's deadline applies too), and the sessions a key and all
    # keys together may hold (a new one takes the place of the least recently used idle one
    # first); a session idle this long is closed. See gateway/mcp/gate.py.
    mcp_max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    mcp_sessions: int = Field(512, ge=1)
    mcp_sessions_per_key: int = Field(32, ge=1)
    mcp_session_idle: float = Field(1800.0, gt=0)
    # Stored Responses ids the gateway remembers per key (the oldest go first); fleet/stored.py.
    stored_per_key: int = Field(2000, ge=1)
    # /metrics on its own port (0 = served on the main port, behind the API key when keys are set).
    metrics_port: int = 0
    drain_seconds: float = Field(30.0, ge=0)
    log_requests: bool = True
    log_prompts: bool = False  # add the request's messages (or prompt) to its access-log line
    log_level: str = "info"
    # "lean" (default: httptools + asyncio Protocol, the least CPU per request in bench/clients.py),
    # "aiohttp" or "httpx2"; see gateway/upstream/.
    http_client: str = "lean"
    # Where launched replicas' logs go (one file each, size-capped); see fleet/supervisor.py.
    state_dir: Path = Path.home() / ".local" / "state" / "fleet-gateway"
    # `serve --wait N`: hold start-up until every preset has a ready replica, at most N seconds.
    wait_ready: float = Field(0.0, ge=0)
