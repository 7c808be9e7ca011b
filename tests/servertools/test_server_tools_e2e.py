"""Server tools through the gateway with the official SDKs, against a simulated replica and a
stub SearXNG and web on 127.0.0.1: the model calls the tool as a function (the simulator's
`[[tool NAME ARGS]]` marker), the gateway runs it and sends the conversation on, and the client
gets its dialect's own blocks, whole or streamed. The stub's loopback address is refused for
web_fetch unless the table's `allow_networks` exempts it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.servertools.stub import StubWeb
from tests.support.harness import Running, run_gateway
from tests.support.servers import ThreadServer, serve, sim_replica

SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
FETCH = {"type": "web_fetch_20250910", "name": "web_fetch"}
ASK_SEARCH = '[[tool web_search {"query": "fleet gateway install"}]]'


@pytest.fixture(scope="module")
def web() -> Iterator[tuple[ThreadServer, StubWeb]]:
    stub = StubWeb()
    with serve(stub) as server:
        yield server, stub


@pytest.fixture(scope="module")
def replica() -> Iterator[ThreadServer]:
    server = sim_replica("llamacpp", "small-served", context=32768)
    yield server
    server.stop()


def table(replica: ThreadServer, web: ThreadServer, server_tools: bool = True, exempt: bool = False) -> str:
    block = ""
    if server_tools:
        networks = "[127.0.0.1/32]" if exempt else "[]"
        block = f"""
server_tools:
  search: {{url: "{web.url}/search"}}
  fetch: {{allow: ["127.0.0.1"], ports: [{web.port}], allow_networks: {networks}}}
"""
    return f"""
defaults: {{max_tokens: 512, min_max_tokens: 0}}
presets:
  small:
    served_model: small-served
    aliases: ["claude-*", "gpt-*"]
    replicas: [{{name: l, url: "{replica.url}", engine: llamacpp}}]
routing: {{default: small}}
{block}
"""


@pytest.fixture(scope="module")
def gateway(replica: ThreadServer, web: tuple[ThreadServer, StubWeb]) -> Iterator[Running]:
    with run_gateway(table(replica, web[0])) as running:
        yield running


@pytest.fixture
def claude(gateway: Running) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0) as client:
        yield client


def block_types(message: Any) -> list[str]:
    return [block.type for block in message.content]


def test_claude_web_search_runs_in_the_gateway(
    claude: anthropic.Anthropic, web: tuple[ThreadServer, StubWeb]
) -> None:
    raw = claude.messages.with_raw_response.create(
        model="claude-haiku-4-5",
        max_tokens=512,
        tools=[SEARCH],  # type: ignore[list-item]
        messages=[{"role": "user", "content": ASK_SEARCH}],
    )
    message = raw.parse()
    assert block_types(message) == ["server_tool_use", "web_search_tool_result", "text"]
    use, result, text = message.content
    assert use.name == "web_search" and use.input == {"query": "fleet gateway install"}  # type: ignore[union-attr]
    assert result.tool_use_id == use.id  # type: ignore[union-attr]
    assert [r.url for r in result.content] == [
        "https://docs.example.org/install",
        "https://blog.example.net/post",
    ]  # type: ignore[union-attr]
    assert text.text.startswith('tool result: Web search results for "fleet gateway install"')  # type: ignore[union-attr]
    assert (
        message.usage.server_tool_use is not None and message.usage.server_tool_use.web_search_requests == 1
    )
    assert "server_tool_rounds=2,searches=1,fetches=0" in raw.headers["x-gateway-rewrites"]
    assert "q=fleet+gateway+install" in web[1].queries[-1]


def test_claude_web_search_streamed(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model="claude-haiku-4-5",
        max_tokens=512,
        tools=[SEARCH],  # type: ignore[list-item]
        messages=[{"role": "user", "content": ASK_SEARCH}],
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert block_types(message) == ["server_tool_use", "web_search_tool_result", "text"]
    assert message.content[0].input == {"query": "fleet gateway install"}  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"


def test_the_stubs_own_address_is_refused_for_web_fetch(
    claude: anthropic.Anthropic, web: tuple[ThreadServer, StubWeb]
) -> None:
    server, stub = web
    page = server.url + "/page"
    asked = len(stub.requests)
    message = claude.messages.create(
        model="claude-haiku-4-5",
        max_tokens=512,
        tools=[FETCH],  # type: ignore[list-item]
        messages=[{"role": "user", "content": f'Read {page} [[tool web_fetch {{"url": "{page}"}}]]'}],
    )
    assert block_types(message) == ["server_tool_use", "web_fetch_tool_result", "text"]
    result = message.content[1]
    assert result.content.type == "web_fetch_tool_result_error"  # type: ignore[union-attr]
    assert result.content.error_code == "url_not_accessible"  # type: ignore[union-attr]
    assert len(stub.requests) == asked  # nothing reached the stub


def test_web_fetch_reads_the_page_when_the_tests_setting_allows_loopback(
    replica: ThreadServer, web: tuple[ThreadServer, StubWeb]
) -> None:
    server, _ = web
    page = server.url + "/page"
    with (
        run_gateway(table(replica, server, exempt=True)) as running,
        anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0) as client,
    ):
        message = client.messages.create(
            model="claude-haiku-4-5",
            max_tokens=512,
            tools=[FETCH],  # type: ignore[list-item]
            messages=[{"role": "user", "content": f'Read {page} [[tool web_fetch {{"url": "{page}"}}]]'}],
        )
    result = message.content[1]
    assert result.content.type == "web_fetch_result"  # type: ignore[union-attr]
    assert result.content.content.title == "Fleet docs"  # type: ignore[union-attr]
    assert "Run fleet-gateway serve." in result.content.content.source.data  # type: ignore[union-attr]
    assert message.content[2].text.startswith(f"tool result: Content of {page} (Fleet docs):")  # type: ignore[union-attr]
    assert message.usage.server_tool_use is not None and message.usage.server_tool_use.web_fetch_requests == 1


def test_codex_web_search_runs_in_the_gateway(gateway: Running) -> None:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as codex:
        response = codex.responses.create(
            model="gpt-5-mini",
            input=ASK_SEARCH,
            tools=[{"type": "web_search"}],
        )
        with codex.responses.stream(
            model="gpt-5-mini", input=ASK_SEARCH, tools=[{"type": "web_search"}]
        ) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    call, message = response.output
    assert call.type == "web_search_call" and call.status == "completed"
    assert call.action.query == "fleet gateway install"  # type: ignore[union-attr]
    assert message.type == "message" and response.output_text.startswith("tool result: Web search results")
    assert "response.web_search_call.completed" in kinds and kinds[-1] == "response.completed"
    assert [item.type for item in final.output] == ["web_search_call", "message"]


def test_without_server_tools_in_the_table_nothing_runs(
    replica: ThreadServer, web: tuple[ThreadServer, StubWeb]
) -> None:
    server, stub = web
    queries = len(stub.queries)
    with (
        run_gateway(table(replica, server, server_tools=False)) as running,
        anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0) as client,
    ):
        message = client.messages.create(
            model="claude-haiku-4-5",
            max_tokens=512,
            tools=[SEARCH],  # type: ignore[list-item]
            messages=[{"role": "user", "content": ASK_SEARCH}],
        )
    assert "server_tool_use" not in block_types(message) and len(stub.queries) == queries
