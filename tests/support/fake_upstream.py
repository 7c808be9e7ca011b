"""A scripted upstream client for driving the request path in process (like HTTPX's MockTransport):
no socket, no server; each test says what each replica answers and sees what was sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.upstream import BodyFailed, Timeouts, UpstreamError


@dataclass
class Scripted:
    """One replica's answer: a status, headers and a body in chunks. `hold` makes the body wait
    (forever, or until the event is set) before chunk `hold_at`; `fail_at` breaks it off there."""

    status: int = 200
    chunks: Sequence[bytes] = ()
    headers: Mapping[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    hold: asyncio.Event | None = None
    hold_at: int = 0
    fail_at: int | None = None
    closed: bool = False
    read_to_end: bool = False

    async def chunks_iter(self) -> AsyncIterator[bytes]:
        for index, chunk in enumerate(self.chunks):
            if self.hold is not None and index == self.hold_at:
                await self.hold.wait()
            if self.fail_at is not None and index == self.fail_at:
                raise BodyFailed("the replica went away")
            yield chunk
        self.read_to_end = True


class FakeResponse:
    def __init__(self, script: Scripted) -> None:
        self.script = script
        self.status = script.status
        self.headers = dict(script.headers)

    def chunks(self) -> AsyncIterator[bytes]:
        return self.script.chunks_iter()

    async def read(self, limit: int | None = None) -> bytes:
        data = b"".join([chunk async for chunk in self.script.chunks_iter()])
        return data if limit is None else data[:limit]

    async def close(self) -> None:
        self.script.closed = True


# What llama-server answers (400) to a prompt past its context, on chat and Messages alike.
LLAMA_SERVER_OVERFLOW: dict[str, Any] = {
    "error": {
        "code": 400,
        "message": "request (5000 tokens) exceeds the available context size (4096 tokens), try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 5000,
        "n_ctx": 4096,
    }
}


def whole(payload: dict[str, Any], status: int = 200) -> Scripted:
    return Scripted(status=status, chunks=[orjson.dumps(payload)])


def sse(*events: dict[str, Any] | str, done: bool = True) -> Scripted:
    chunks = [
        (b"data: " + (orjson.dumps(e) if isinstance(e, dict) else e.encode()) + b"\n\n") for e in events
    ]
    if done:
        chunks.append(b"data: [DONE]\n\n")
    return Scripted(chunks=chunks, headers={"content-type": "text/event-stream"})


def chat_answer(text: str = "hello", prompt: int = 5, completion: int = 3) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "served",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


@dataclass
class Sent:
    url: str
    headers: list[tuple[str, str]]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


class FakeUpstream:
    """An UpstreamClient whose answer for each request comes from `answer(url, body)`: a Scripted
    answer or an UpstreamError to raise (a refused connection, say)."""

    def __init__(self, answer: Callable[[str, Any], Scripted | UpstreamError]) -> None:
        self.answer = answer
        self.sent: list[Sent] = []
        self.answers: list[Scripted] = []

    async def send(
        self, url: str, headers: list[tuple[str, str]], body: bytes, timeouts: Timeouts, method: str = "POST"
    ) -> FakeResponse:
        self.sent.append(Sent(url, headers, body))
        outcome = self.answer(url, orjson.loads(body) if body else None)
        if isinstance(outcome, UpstreamError):
            raise outcome
        self.answers.append(outcome)
        return FakeResponse(outcome)

    async def get(self, url: str, headers: list[tuple[str, str]], timeout: float) -> tuple[int, bytes]:
        return 200, b"{}"

    async def aclose(self) -> None:
        return None
