"""What stands in front of the SDK's session manager on `/mcp`: a POST's body read within a size
and a deadline (body.py), each session kept for the key that opened it and within the per-key and
total caps (sessions.py). Its refusals are JSON-RPC error objects, as the SDK's own are, with the
HTTP status an MCP client acts on (404: open a new session; 408, 413, 429, 503), and are recorded
like any refused request (endpoint `mcp`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from gateway.fleet.stored import OPEN_OWNER, Owner
from gateway.mcp.body import BodyRefused, ClientLeft, content_length, read_body, replay
from gateway.mcp.sessions import SessionBook
from gateway.ops.exchange import Exchange
from gateway.settings import Settings
from gateway.team.keys import OPEN
from gateway.types import ASGIApp, Message, Receive, Scope, Send

SESSION_HEADER = b"mcp-session-id"
VERSION_HEADER = b"mcp-protocol-version"
INVALID_REQUEST = -32600  # JSON-RPC's code; the SDK answers an unknown session with it too
SERVER_ERROR = -32000  # the implementation-defined range: a limit of this server

Recorder = Callable[[Exchange], None]


@dataclass(frozen=True)
class McpLimits:
    """The limits of `/mcp`, from the GATEWAY_MCP_* settings (and the chat path's body deadline)."""

    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 30.0
    sessions: int = 512
    sessions_per_key: int = 32
    session_idle: float = 1800.0

    @classmethod
    def of(cls, settings: Settings) -> McpLimits:
        return cls(
            settings.mcp_max_body_bytes,
            settings.body_timeout,
            settings.mcp_sessions,
            settings.mcp_sessions_per_key,
            settings.mcp_session_idle,
        )


class SessionGate:
    """ASGI app in front of `app` (the SDK's `handle_request`): see the module's docstring."""

    def __init__(
        self,
        app: ASGIApp,
        limits: McpLimits,
        record: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app, self.limits, self.record, self.clock = app, limits, record, clock
        self.book = SessionBook(limits.sessions_per_key, limits.sessions, limits.session_idle)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        body = b""
        if scope["method"] == "POST":
            try:
                body = await read_body(
                    receive, content_length(headers), self.limits.max_body_bytes, self.limits.body_timeout
                )
            except ClientLeft:
                return
            except BodyRefused as refused:
                code = "body_timeout" if refused.status == 408 else "request_too_large"
                await self._refuse(scope, send, refused.status, INVALID_REQUEST, refused.message, code)
                return
            receive = replay(body, receive)
        owner = Owner.of(scope)
        session_id = _header(headers, SESSION_HEADER)
        if session_id is not None:
            if not self.book.visible(session_id, owner):
                # As the SDK answers an id it does not know: the client opens a new session.
                await self._refuse(
                    scope, send, 404, INVALID_REQUEST, "Session not found", "session_not_found"
                )
                return
            await self._serve(session_id, scope, receive, send)
        elif scope["method"] == "POST" and not _modern(headers) and _initialize(body):
            await self._open(owner, scope, receive, send)
        else:
            # A request of the stateless protocol revision, or one the SDK refuses (no session).
            await self.app(scope, receive, send)

    async def _serve(self, session_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.book.begin(session_id, self.clock())
        try:
            await self.app(scope, receive, watch)
        finally:
            self.book.end(session_id, self.clock())
            if status == 404 or (scope["method"] == "DELETE" and 200 <= status < 300):
                self.book.forget(session_id)  # ended by its client, or gone from the SDK already

    async def _open(self, owner: Owner, scope: Scope, receive: Receive, send: Send) -> None:
        # A gateway without keys has one caller, its local user (every agent it runs): the total
        # is its cap.
        per_key = self.limits.sessions if owner == OPEN_OWNER else None
        admission = self.book.admit(owner.key, self.clock(), per_key)
        for session_id in admission.evict:
            await self._close(session_id)
        if admission.refused is not None:
            if admission.refused == "key" and per_key is None:
                status, message = (
                    429,
                    (
                        f"This key holds {self.limits.sessions_per_key} MCP sessions, each with a request "
                        "in flight (GATEWAY_MCP_SESSIONS_PER_KEY); end one (DELETE) or retry later"
                    ),
                )
            else:
                status, message = (
                    503,
                    (
                        f"The gateway holds {self.limits.sessions} MCP sessions, each with a request in "
                        "flight (GATEWAY_MCP_SESSIONS); retry later"
                    ),
                )
            await self._refuse(scope, send, status, SERVER_ERROR, message, "too_many_sessions", retry=True)
            return
        opened: str | None = None
        answered = False

        async def watch(message: Message) -> None:
            nonlocal opened, answered
            if message["type"] == "http.response.start" and not answered:
                answered = True
                found = _header(message.get("headers", []), SESSION_HEADER)
                opened = found if found is not None and message["status"] < 400 else None
                self.book.opened(owner.key, opened, self.clock())
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if not answered:
                self.book.opened(owner.key, None, self.clock())
            elif opened is not None:
                self.book.end(opened, self.clock())

    async def _close(self, session_id: str) -> None:
        """End a session in the SDK as its client would: a DELETE with its id."""
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "DELETE",
            "scheme": "http",
            "path": "/mcp",
            "raw_path": b"/mcp",
            "query_string": b"",
            "root_path": "",
            "headers": [(SESSION_HEADER, session_id.encode("latin-1"))],
            "client": None,
            "server": None,
        }
        messages = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> Message:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def discard(message: Message) -> None:
            return None

        await self.app(scope, receive, discard)

    async def _refuse(
        self, scope: Scope, send: Send, status: int, code: int, message: str, label: str, retry: bool = False
    ) -> None:
        body = orjson.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if retry:
            headers.append((b"retry-after", b"5"))
        client = scope.get("client")
        now = self.clock()
        ex = Exchange(
            request_id=os.urandom(8).hex(),
            endpoint="mcp",
            started=now,
            client=client[0] if client else "",
            outcome="rejected",
            identity=scope.get("gateway.identity") or OPEN,
        )
        ex.status, ex.error_code = status, label
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        finally:
            ex.finished = self.clock()
            if self.record is not None:
                self.record(ex)


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            text: str = value.decode("latin-1")
            return text
    return None


def _modern(headers: list[tuple[bytes, bytes]]) -> bool:
    """A revision without sessions (each POST stands alone): the SDK routes it the same way."""
    version = _header(headers, VERSION_HEADER)
    return version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS


def _initialize(body: bytes) -> bool:
    """A JSON-RPC `initialize` request: the only message that opens a session."""
    try:
        message = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(message, dict) and message.get("method") == "initialize"
