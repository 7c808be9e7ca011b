"""A stub of the web on 127.0.0.1 for the server-tool tests: SearXNG's JSON search API at
`/search`, pages, redirects, a large page and a page that never finishes. It records what it was
asked, so a test can tell whether a refused fetch reached it."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from gateway.types import Receive, Scope, Send

PAGE = (
    "<html><head><title>Fleet docs</title><style>p{}</style></head><body>"
    "<h1>Install</h1><p>Run <b>fleet-gateway serve</b>.</p><script>alert(1)</script></body></html>"
)


class StubWeb:
    """An ASGI app; `requests` lists the paths asked, in order."""

    def __init__(self, results: list[dict[str, Any]] | None = None) -> None:
        self.requests: list[str] = []
        self.hosts: list[str] = []  # the Host header of each request
        self.queries: list[str] = []
        self.base = ""  # set by the test once the port is known (for absolute redirects)
        self.results = results or [
            {"url": "https://docs.example.org/install", "title": "Install", "content": "How to install."},
            {
                "url": "https://blog.example.net/post",
                "title": "A post",
                "content": "Notes.",
                "publishedDate": "2026",
            },
            {"url": "ftp://files.example.org/x", "title": "Not http", "content": "skipped"},
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                await send({"type": kind + ".complete"})
                if kind == "lifespan.shutdown":
                    return
        path = scope["path"]
        query = scope.get("query_string", b"").decode()
        self.requests.append(path)
        self.hosts.append(dict(scope["headers"]).get(b"host", b"").decode())
        if path == "/search":
            self.queries.append(query)
            await _answer(
                send, 200, "application/json", orjson.dumps({"query": query, "results": self.results})
            )
        elif path == "/page":
            await _answer(send, 200, "text/html; charset=utf-8", PAGE.encode())
        elif path == "/notes.txt":
            await _answer(send, 200, "text/plain", b"plain notes")
        elif path == "/image.png":
            await _answer(send, 200, "image/png", b"\x89PNG....")
        elif path == "/big":
            await _answer(send, 200, "text/plain", b"x" * (3 << 20))
        elif path == "/hop":
            await _answer(send, 302, "text/plain", b"", [(b"location", b"/page")])
        elif path == "/away":
            await _answer(send, 302, "text/plain", b"", [(b"location", b"http://elsewhere.example.com/")])
        elif path == "/loop":
            await _answer(send, 302, "text/plain", b"", [(b"location", b"/loop")])
        elif path == "/stall":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
            )
            await send({"type": "http.response.body", "body": b"start", "more_body": True})
            # Never finishes: waits (bounded) until the client gives up and leaves.
            async with asyncio.timeout(30):
                while (await receive())["type"] != "http.disconnect":
                    pass
        else:
            await _answer(send, 404, "text/plain", b"not found")


async def _answer(
    send: Send, status: int, content_type: str, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
