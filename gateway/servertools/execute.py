"""Running `web_search` and `web_fetch` for the model: the search backend and the fetch policy of
the table, every request bounded in size and time. Results and failures come back as values (a
failure carries the error code the Messages dialect names it by), never as exceptions: a failed
search is something the model is told, not a failed request.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

import orjson

from gateway.routing.table import FetchPolicy, SearchBackend
from gateway.servertools import http
from gateway.servertools.guard import Guard, Refused, Resolver, client_allows, parse, system_resolver
from gateway.servertools.text import is_text, page_text

MAX_QUERY = 400  # characters of a search query
TRUNCATED = "\n[The page was cut here: it is longer than the gateway's limit.]"
REDIRECTS = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class Hit:
    """One search result as the model and the client see it: URL, title, snippet and the page's age
    where the backend gave one."""

    url: str
    title: str
    snippet: str
    page_age: str | None = None


@dataclass(frozen=True)
class Searched:
    """What a `web_search` call came to: its query and hits, or the error code the Messages dialect
    names the failure by."""

    query: str
    hits: tuple[Hit, ...] = ()
    error: str | None = None  # web_search_tool_result_error code


@dataclass(frozen=True)
class Fetched:
    """What a `web_fetch` call came to: the page's URL, title, text (cut to the policy's size, then
    `truncated`) and retrieval time, or the error code the Messages dialect names the failure by."""

    url: str
    title: str = ""
    text: str = ""
    retrieved_at: str = ""
    truncated: bool = False
    error: str | None = None  # web_fetch_tool_result_error code


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Executor:
    """Runs the two tools with the table's settings (either may be absent: not configured)."""

    def __init__(
        self,
        search: SearchBackend | None,
        fetch: FetchPolicy | None,
        resolver: Resolver = system_resolver,
        now: Callable[[], str] = _now,
    ) -> None:
        self.search_backend = search
        self.fetch_policy = fetch
        self.resolver = resolver
        self.guard = Guard(fetch, resolver) if fetch is not None else None
        self.now = now

    # --- web_search ------------------------------------------------------------------------------

    async def search(
        self, query: object, allowed: Sequence[str] | None = None, blocked: Sequence[str] | None = None
    ) -> Searched:
        """Runs one `web_search` on the configured SearXNG backend: the hits, at most `max_results`,
        with the client's allowed and blocked domains applied. A bad or overlong query, a missing
        backend or a failed search comes back as an error code, never raised."""
        backend = self.search_backend
        if not isinstance(query, str) or not query.strip():
            return Searched(str(query or ""), error="invalid_tool_input")
        if len(query) > MAX_QUERY:
            return Searched(query, error="query_too_long")
        if backend is None:
            return Searched(query, error="unavailable")
        target = parse(f"{backend.url}?{urlencode({'q': query, 'format': 'json'})}")
        try:
            address = await self._address(target.host, target.port)
            answer = await http.get(
                target,
                address,
                timeout=backend.timeout,
                max_bytes=backend.max_bytes,
                accept="application/json",
            )
        except (OSError, http.FetchFailed):
            return Searched(query, error="unavailable")
        if answer.status != 200 or answer.truncated:
            return Searched(query, error="too_many_requests" if answer.status == 429 else "unavailable")
        try:
            payload = orjson.loads(answer.body)
        except orjson.JSONDecodeError:
            return Searched(query, error="unavailable")
        return Searched(query, tuple(_hits(payload, backend.max_results, allowed, blocked)))

    async def _address(self, host: str, port: int) -> str:
        """The search backend's address: the operator named it, so a private one is fine."""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            found = await self.resolver(host, port)
            if not found:
                raise OSError("the search backend's name does not resolve") from None
            return found[0].split("%", 1)[0]
        return host

    # --- web_fetch -------------------------------------------------------------------------------

    async def fetch(
        self, url: object, allowed: Sequence[str] | None = None, blocked: Sequence[str] | None = None
    ) -> Fetched:
        policy, guard = self.fetch_policy, self.guard
        if not isinstance(url, str) or not url:
            return Fetched(str(url or ""), error="invalid_tool_input")
        if policy is None or guard is None:
            return Fetched(url, error="unavailable")
        try:
            async with asyncio.timeout(policy.timeout):  # one deadline, redirects included
                return await self._fetch(url, policy, guard, allowed, blocked)
        except Refused as refused:
            return Fetched(url, error=refused.code)
        except (TimeoutError, http.FetchFailed):
            return Fetched(url, error="url_not_accessible")

    async def _fetch(
        self,
        url: str,
        policy: FetchPolicy,
        guard: Guard,
        allowed: Sequence[str] | None,
        blocked: Sequence[str] | None,
    ) -> Fetched:
        checked = await guard.check(url, allowed, blocked)
        for _ in range(policy.max_redirects + 1):
            answer = await http.get(
                checked.target,
                checked.address,
                timeout=policy.timeout,
                max_bytes=policy.max_bytes,
                accept="text/html, text/plain;q=0.9, */*;q=0.1",
            )
            location = answer.headers.get("location")
            if answer.status not in REDIRECTS or not location:
                break
            checked = await guard.redirect(checked.target, location, allowed, blocked)
        else:
            return Fetched(url, error="url_not_accessible")
        if answer.status in REDIRECTS or answer.status >= 400:
            return Fetched(url, error="url_not_accessible")
        content_type = answer.headers.get("content-type", "")
        if not is_text(content_type):
            return Fetched(url, error="unsupported_content_type")
        title, text = page_text(answer.body, content_type, policy.max_chars)
        truncated = answer.truncated or len(text) >= policy.max_chars
        # The note is part of the text: the history replays the same bytes (wires.py).
        return Fetched(
            checked.target.url, title, text + (TRUNCATED if truncated else ""), self.now(), truncated
        )


def _hits(
    payload: object, limit: int, allowed: Sequence[str] | None, blocked: Sequence[str] | None
) -> list[Hit]:
    """SearXNG's `results` ({url, title, content, publishedDate}) as hits: http(s) URLs only, the
    client's domain filters applied, at most `limit`."""
    results = payload.get("results") if isinstance(payload, dict) else None
    hits: list[Hit] = []
    for result in results if isinstance(results, list) else ():
        if len(hits) >= limit:
            break
        if not isinstance(result, dict) or not isinstance(result.get("url"), str):
            continue
        try:
            target = parse(result["url"])
        except Refused:
            continue
        if not client_allows(target.host, allowed, blocked):
            continue
        age = result.get("publishedDate")
        hits.append(
            Hit(
                url=result["url"][:2048],
                title=str(result.get("title") or "")[:300],
                snippet=str(result.get("content") or "")[:1000],
                page_age=age[:40] if isinstance(age, str) else None,
            )
        )
    return hits
