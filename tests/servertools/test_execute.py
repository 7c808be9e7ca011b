"""web_search against a SearXNG stub and web_fetch against stub pages on 127.0.0.1: results as
values, failures as the error codes the model is told, every fetch bounded and checked (the stub's
own loopback address is refused unless the test's setting exempts it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.routing.table import FetchPolicy, SearchBackend
from gateway.servertools.execute import TRUNCATED, Executor
from tests.servertools.stub import StubWeb
from tests.support.servers import ThreadServer, serve


@pytest.fixture(scope="module")
def web() -> Iterator[tuple[ThreadServer, StubWeb]]:
    stub = StubWeb()
    with serve(stub) as server:
        stub.base = server.url
        yield server, stub


def policy(server: ThreadServer, **fields: Any) -> FetchPolicy:
    values: dict[str, Any] = {"allow": ["127.0.0.1", "docs.test"], "ports": [server.port], **fields}
    return FetchPolicy(**values)


EXEMPT = {"allow_networks": ["127.0.0.1/32"]}


async def to_loopback(host: str, port: int) -> list[str]:
    return ["127.0.0.1"]


def test_search_reads_searxng_results_and_keeps_http_ones(web: tuple[ThreadServer, StubWeb]) -> None:
    server, stub = web
    executor = Executor(SearchBackend(url=server.url + "/search", max_results=5), None)
    found = asyncio.run(executor.search("fleet gateway install"))
    assert found.error is None and [h.url for h in found.hits] == [
        "https://docs.example.org/install",
        "https://blog.example.net/post",
    ]
    assert (
        found.hits[1].page_age == "2026"
        and "format=json" in stub.queries[-1]
        and "q=fleet" in stub.queries[-1]
    )
    narrowed = asyncio.run(executor.search("x", allowed=["example.org"]))
    assert [h.url for h in narrowed.hits] == ["https://docs.example.org/install"]


def test_search_failures_are_values(web: tuple[ThreadServer, StubWeb]) -> None:
    server, _ = web
    assert asyncio.run(Executor(None, None).search("x")).error == "unavailable"
    down = Executor(SearchBackend(url=server.url + "/nowhere"), None)
    assert asyncio.run(down.search("x")).error == "unavailable"
    executor = Executor(SearchBackend(url=server.url + "/search"), None)
    assert asyncio.run(executor.search("")).error == "invalid_tool_input"
    assert asyncio.run(executor.search("q" * 500)).error == "query_too_long"


def test_the_stubs_own_loopback_address_is_refused_without_the_tests_setting(
    web: tuple[ThreadServer, StubWeb],
) -> None:
    server, stub = web
    before = len(stub.requests)
    refused = asyncio.run(Executor(None, policy(server)).fetch(server.url + "/page"))
    assert refused.error == "url_not_accessible" and len(stub.requests) == before  # never connected
    by_name = asyncio.run(
        Executor(None, policy(server), to_loopback).fetch(f"http://docs.test:{server.port}/page")
    )
    assert by_name.error == "url_not_accessible" and len(stub.requests) == before


def test_a_fetched_page_is_its_text(web: tuple[ThreadServer, StubWeb]) -> None:
    server, _ = web
    fetched = asyncio.run(Executor(None, policy(server, **EXEMPT)).fetch(server.url + "/page"))
    assert fetched.error is None and fetched.title == "Fleet docs"
    assert (
        "Run fleet-gateway serve." in fetched.text
        and "alert" not in fetched.text
        and "p{}" not in fetched.text
    )
    plain = asyncio.run(Executor(None, policy(server, **EXEMPT)).fetch(server.url + "/notes.txt"))
    assert plain.text == "plain notes"


def test_the_connection_goes_to_the_checked_address_with_the_name_as_host(
    web: tuple[ThreadServer, StubWeb],
) -> None:
    server, stub = web
    executor = Executor(None, policy(server, **EXEMPT), to_loopback)
    fetched = asyncio.run(executor.fetch(f"http://docs.test:{server.port}/notes.txt"))
    assert fetched.text == "plain notes" and stub.hosts[-1] == f"docs.test:{server.port}"


def test_redirects_are_checked_like_the_first_url(web: tuple[ThreadServer, StubWeb]) -> None:
    server, _ = web
    executor = Executor(None, policy(server, **EXEMPT))
    assert "Install" in asyncio.run(executor.fetch(server.url + "/hop")).text
    assert asyncio.run(executor.fetch(server.url + "/away")).error == "url_not_allowed"
    assert asyncio.run(executor.fetch(server.url + "/loop")).error == "url_not_accessible"


def test_fetches_are_bounded_in_size_and_time(web: tuple[ThreadServer, StubWeb]) -> None:
    server, _ = web
    executor = Executor(None, policy(server, max_bytes=4096, max_chars=1000, timeout=0.5, **EXEMPT))
    big = asyncio.run(executor.fetch(server.url + "/big"))
    assert big.truncated and big.text.endswith(TRUNCATED) and len(big.text) == 1000 + len(TRUNCATED)
    assert asyncio.run(executor.fetch(server.url + "/stall")).error == "url_not_accessible"
    assert asyncio.run(executor.fetch(server.url + "/image.png")).error == "unsupported_content_type"
    assert asyncio.run(executor.fetch(server.url + "/missing")).error == "url_not_accessible"
    assert asyncio.run(Executor(None, None).fetch(server.url + "/page")).error == "unavailable"
