"""One tool call as one request on the gateway's own path, in process.

A tool call becomes an OpenAI chat-completions request handed to `Proxy.handle` through a pair of
ASGI callables, so routing by task, no-think defaults, token budgets, retries, limits and the
record of the exchange are exactly those of any client request. The request streams, so progress
can be reported while the replica generates; when the MCP client cancels, the fake connection
says `http.disconnect`, and the proxy's own disconnect path closes the upstream request (vLLM
aborts it, llama-server frees the slot) and records the exchange as a client disconnect.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from gateway.dialects.registry import Endpoint, for_path
from gateway.team.keys import Identity
from gateway.types import Message, Receive, Scope, Send

Handler = Callable[[Endpoint, Scope, Receive, Send], Awaitable[None]]
Progress = Callable[[int, str], Awaitable[None]]  # (completion tokens so far, message)

_chat = for_path("/v1/chat/completions")
assert _chat is not None
CHAT: Endpoint = _chat
# How often progress goes to the client while tokens arrive: often enough to show life, rarely
# enough not to flood a slow orchestrator with notifications.
PROGRESS_EVERY = 0.5


@dataclass
class Outcome:
    """What a tool call's request came back with."""

    status: int = 0
    text: str = ""
    error: str | None = None
    preset: str = ""
    replica: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0


class _Stream:
    """Reads the relayed SSE bytes as they are sent: the answer's text, usage and any error."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.pending = bytearray()
        self.parts: list[str] = []
        self.tokens = 0
        self.whole = bytearray()  # a non-SSE answer (an error envelope)
        self.loading: str | None = None  # the gateway's latest `: loading PRESET, N s` comment
        self.replica: str | None = (
            None  # `: replica NAME`, when the stream opened before a replica was chosen
        )

    def feed(self, chunk: bytes, sse: bool) -> None:
        if not sse:
            self.whole += chunk
            return
        self.pending += chunk
        while (cut := self.pending.find(b"\n\n")) >= 0:
            event = bytes(self.pending[:cut])
            del self.pending[: cut + 2]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())
                elif line.startswith(b": loading "):
                    self.loading = line[2:].decode("utf-8", "replace")
                elif line.startswith(b": replica "):
                    self.replica = line[10:].decode("utf-8", "replace")

    def _data(self, data: bytes) -> None:
        if data == b"[DONE]" or not data:
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        if isinstance(event.get("error"), dict):
            self.outcome.error = str(event["error"].get("message") or "the replica failed mid-answer")
        if isinstance(event.get("usage"), dict):
            self.outcome.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                self.parts.append(delta["content"])
                self.tokens += 1

    def finish(self) -> None:
        self.outcome.text = "".join(self.parts)
        if self.whole:
            try:
                envelope = orjson.loads(self.whole)
                message = envelope.get("error", {}).get("message") if isinstance(envelope, dict) else None
            except (orjson.JSONDecodeError, AttributeError):
                message = None
            self.outcome.error = str(message or f"the gateway answered HTTP {self.outcome.status}")


async def run(
    handle: Handler,
    body: dict[str, Any],
    *,
    tool: str,
    client_id: str,
    identity: Identity | None = None,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Outcome:
    """Sends `body` (chat completions, streamed) through the gateway's request path."""
    outcome = Outcome()
    stream = _Stream(outcome)
    raw = orjson.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    gone = asyncio.Event()
    delivered = False
    started = clock()
    sse = False
    last_report = started

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal sse, last_report
        if message["type"] == "http.response.start":
            outcome.status = message["status"]
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in message.get("headers", ())}
            sse = headers.get("content-type", "").startswith("text/event-stream")
            outcome.preset = headers.get("x-gateway-preset", "")
            outcome.replica = headers.get("x-gateway-replica", "")
        elif message["type"] == "http.response.body":
            loading = stream.loading
            stream.feed(message.get("body", b""), sse)
            if stream.replica:
                outcome.replica = stream.replica
            if progress is not None and stream.loading is not None and stream.loading != loading:
                await progress(0, stream.loading)  # the preset must start first: say so
            now = clock()
            if progress is not None and stream.tokens and now - last_report >= PROGRESS_EVERY:
                last_report = now
                await progress(stream.tokens, f"{stream.tokens} tokens from {outcome.preset or 'the fleet'}")

    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": CHAT.path,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": None,
        "gateway.client": client_id,
        # The MCP caller's key: its presets, priority and limits hold for the tool's request too.
        "gateway.identity": identity,
        "gateway.tool": tool,
    }
    task = asyncio.ensure_future(handle(CHAT, scope, receive, send))
    try:
        await asyncio.shield(task)
    except BaseException:
        # The MCP client cancelled (or the session closed): the request's client "leaves", and
        # the proxy closes the upstream request; wait for that so the slot is free on return.
        gone.set()
        with anyio.CancelScope(shield=True):
            await asyncio.wait([task], timeout=10)
        raise
    stream.finish()
    outcome.seconds = round(clock() - started, 3)
    return outcome
