"""A replica's streamed answer rewritten on the way in, piece by piece (messages_chat.py turns a
chat stream into Messages events): to the relay it is the answer the client's endpoint gives."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from gateway.types import ReadBytes
from gateway.upstream import UpstreamResponse


class Transcoder(Protocol):
    def feed(self, chunk: bytes) -> bytes: ...

    def end(self) -> bytes: ...


class Transcoded:
    """`response` with its body passed through `transcoder`; status, headers and close are its own.
    An error answer (status 300 and above) is left as the replica sent it."""

    def __init__(self, response: UpstreamResponse, transcoder: Transcoder) -> None:
        self._response = response
        self._transcoder = transcoder
        self.status: int = response.status
        self.headers: Mapping[str, str] = response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        if self.status >= 300:
            async for chunk in self._response.chunks():
                yield chunk
            return
        async for chunk in self._response.chunks():
            out = self._transcoder.feed(chunk)
            if out:
                yield out
        tail = self._transcoder.end()
        if tail:
            yield tail

    async def read(self, limit: int | None = None) -> ReadBytes:
        if self.status >= 300:
            return await self._response.read(limit)
        body = bytearray()
        async for chunk in self.chunks():
            body += chunk
            if limit is not None and len(body) >= limit:
                break
        return body if limit is None else body[:limit]  # not copied again: see ReadBytes

    async def close(self) -> None:
        await self._response.close()
