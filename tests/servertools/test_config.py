"""The `server_tools` block of routes.yaml: off unless present, each part validated at load."""

from __future__ import annotations

import pytest

from gateway.routing.table import TableError, parse_table

BASE = """
presets: {m: {served_model: m, replicas: [{name: r, url: "http://r.test:1", engine: llamacpp}]}}
routing: {default: m}
"""


def test_server_tools_are_off_unless_configured() -> None:
    assert parse_table(BASE).server_tools is None


def test_a_full_block_loads() -> None:
    table = parse_table(
        BASE
        + """
server_tools:
  search: {url: "http://searxng:8080/search", max_results: 8}
  fetch: {allow: [docs.python.org, "*.Readthedocs.io"], allow_networks: [10.1.2.0/24], max_redirects: 1}
  max_rounds: 3
"""
    )
    tools = table.server_tools
    assert tools is not None and tools.search is not None and tools.fetch is not None
    assert tools.fetch.allow == ["docs.python.org", "*.readthedocs.io"] and tools.fetch.prior_context_only
    assert tools.fetch.ports == [80, 443] and tools.max_rounds == 3


@pytest.mark.parametrize(
    ("block", "said"),
    [
        ("{}", "configure `search`, `fetch` or both"),
        ("{search: {url: 'file:///etc/hosts'}}", "server_tools.search.url"),
        ("{search: {url: 'http://user:pw@s.test/search'}}", "without credentials"),
        ("{fetch: {allow: []}}", "server_tools.fetch.allow"),
        ("{fetch: {allow: ['https://docs.python.org/']}}", "is not a host name"),
        ("{fetch: {allow: [x.org], allow_networks: [everything]}}", "is not a network"),
        ("{fetch: {allow: [x.org], ports: [0]}}", "server_tools.fetch.ports"),
        ("{search: {url: 'http://s.test/search'}, max_rounds: 50}", "server_tools.max_rounds"),
        ("{search: {url: 'http://s.test/search', engine: google}}", "unknown key"),
    ],
)
def test_a_bad_block_is_refused_at_load_naming_the_key(block: str, said: str) -> None:
    with pytest.raises(TableError, match=said.replace("*", r"\*")):
        parse_table(BASE + f"server_tools: {block}\n")
