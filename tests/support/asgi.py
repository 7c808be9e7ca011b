"""Call an ASGI app in-process and keep what it sends: for the edge layers and the error renderer,
which need no socket to be tested."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.types import ASGIApp, Message, Scope


@dataclass
class Sent:
    """Every message an app passed to `send`, in order."""

    messages: list[Message] = field(default_factory=list)

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def start(self) -> Message:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        assert len(starts) == 1, self.messages
        return starts[0]

    @property
    def status(self) -> int:
        return int(self.start["status"])

    @property
    def header_list(self) -> list[tuple[str, str]]:
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.start["headers"]]

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.header_list)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")

    def json(self) -> Any:
        return orjson.loads(self.body)


def http_scope(
    path: str,
    method: str = "POST",
    headers: Sequence[tuple[str, str]] = (),
    client: tuple[str, int] | None = ("127.0.0.1", 50000),
) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": client,
        "server": ("127.0.0.1", 8080),
    }


async def empty_receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


@dataclass
class Downstream:
    """The app behind a middleware: records the scopes it got and answers 204."""

    scopes: list[Scope] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def call(app: ASGIApp, scope: Scope) -> Sent:
    sent = Sent()
    await app(scope, empty_receive, sent)
    return sent
