"""An MCP request's body, read whole within a size and a deadline before the SDK sees it.

The SDK reads a body for as long as the client takes to send it: 40 connections each trickling a
4 MB body held their sockets and buffers 45 s and more (RSS 88 -> 258 MiB), where the chat path
answers 408 at `GATEWAY_BODY_TIMEOUT` (30 s). And it answers an oversized body with a plain-text
413 that no MCP client reads. Here both are JSON-RPC errors, with the HTTP status of the chat
path's answer (413, 408), and the body the SDK then reads is the one already in memory.
"""

from __future__ import annotations

import asyncio

from gateway.types import Message, Receive


class BodyRefused(Exception):
    """The body was not read: too large, or not there in time."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ClientLeft(Exception):
    """The client closed the connection before its body was whole."""


async def read_body(receive: Receive, content_length: int | None, limit: int, timeout: float) -> bytes:
    """The whole body; BodyRefused(413) without reading it when Content-Length is already over
    `limit`, or as soon as the bytes read are; BodyRefused(408) past `timeout` seconds."""
    if content_length is not None and content_length > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientLeft
                body += message.get("body", b"")
                if len(body) > limit:
                    raise _too_large(limit)
                if not message.get("more_body", False):
                    return bytes(body)
    except TimeoutError:
        raise BodyRefused(408, f"The request body did not arrive within {timeout:g} s") from None


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the body read once, then whatever the connection says next (the
    SDK listens for the client's disconnect while it streams an answer)."""
    given = False

    async def next_message() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return next_message


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None
    return None


def _too_large(limit: int) -> BodyRefused:
    return BodyRefused(413, f"The request body is larger than {limit} bytes (GATEWAY_MCP_MAX_BODY_BYTES)")
