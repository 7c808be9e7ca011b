"""The alternative upstream client, on httpx2 (the maintained continuation of httpx, same API)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager

import httpx2

from gateway.upstream import (
    PROBE_BODY_LIMIT,
    BodyFailed,
    ConnectFailed,
    HeaderTimeout,
    IdleTimeout,
    ProtocolFailure,
    Reset,
    Timeouts,
    UpstreamError,
)


@contextmanager
def _before_headers() -> Iterator[None]:
    try:
        yield
    except UpstreamError:
        raise
    except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
        raise ConnectFailed("connection to the replica failed") from exc
    except (httpx2.TimeoutException, TimeoutError) as exc:
        raise HeaderTimeout("no response headers in time") from exc
    except (httpx2.RemoteProtocolError, httpx2.ReadError, httpx2.WriteError) as exc:
        # The same exception types arrive mid-body; only the phase makes a retry safe.
        raise Reset("connection closed before response headers") from exc
    except httpx2.HTTPError as exc:
        raise ProtocolFailure("invalid response from the replica") from exc


@contextmanager
def _in_body() -> Iterator[None]:
    try:
        yield
    except (httpx2.TimeoutException, TimeoutError) as exc:
        raise IdleTimeout("the response stalled") from exc
    except httpx2.HTTPError as exc:
        raise BodyFailed("connection broke during the response") from exc


class _Response:
    def __init__(self, response: httpx2.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers: Mapping[str, str] = response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        with _in_body():
            async for chunk in self._response.aiter_raw():
                yield chunk

    async def read(self, limit: int | None = None) -> bytes:
        parts: list[bytes] = []
        size = 0
        with _in_body():
            async for chunk in self._response.aiter_raw():
                parts.append(chunk)
                size += len(chunk)
                if limit is not None and size >= limit:
                    break
        data = b"".join(parts)
        return data if limit is None else data[:limit]

    async def close(self) -> None:
        await self._response.aclose()


class HttpxClient:
    """The upstream client on httpx2: one client created on first use, with no connection cap below
    the gateway's admission limits, no redirects and no environment proxies; httpx's errors are
    raised as `UpstreamError`s."""

    def __init__(self, keepalive_expiry: float) -> None:
        self._keepalive_expiry = keepalive_expiry
        self._client: httpx2.AsyncClient | None = None

    def _get_client(self) -> httpx2.AsyncClient:
        if self._client is None:
            # No connection cap: httpx's default of 100 would silently cap concurrency.
            limits = httpx2.Limits(
                max_connections=None, max_keepalive_connections=None, keepalive_expiry=self._keepalive_expiry
            )
            self._client = httpx2.AsyncClient(
                limits=limits, timeout=None, follow_redirects=False, trust_env=False
            )
        return self._client

    async def send(
        self, url: str, headers: list[tuple[str, str]], body: bytes, timeouts: Timeouts, method: str = "POST"
    ) -> _Response:
        client = self._get_client()
        timeout = httpx2.Timeout(connect=timeouts.connect, read=timeouts.idle, write=timeouts.idle, pool=None)
        request = client.build_request(method, url, content=body, headers=headers, timeout=timeout)
        with _before_headers():
            async with asyncio.timeout(timeouts.first_byte):
                response = await client.send(request, stream=True)
        return _Response(response)

    async def get(self, url: str, headers: list[tuple[str, str]], timeout: float) -> tuple[int, bytes]:
        client = self._get_client()
        request = client.build_request("GET", url, headers=headers, timeout=httpx2.Timeout(timeout))
        with _before_headers():
            async with asyncio.timeout(timeout):
                response = await client.send(request, stream=True)
                try:
                    return response.status_code, await _Response(response).read(PROBE_BODY_LIMIT)
                finally:
                    await response.aclose()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
