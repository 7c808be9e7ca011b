import json
import tomllib
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.routing.table import load_table
from gateway.tools.connect import AGENTS, PresetInfo, from_catalogue, from_table, render

REPO = Path(__file__).resolve().parents[1]
TABLE = load_table(REPO / "routes.yaml")
PRESETS = [PresetInfo("dense", ("coder",), 32768, 32768), PresetInfo("moe", (), None, 8192)]


def test_claude_code_gets_its_environment_and_the_shipped_mapping() -> None:
    text = render("claude", "http://gw:18000/", PRESETS, TABLE)
    assert "export ANTHROPIC_BASE_URL=http://gw:18000\n" in text
    assert "claude-opus-4-8      -> preset dense" in text
    assert "claude-haiku-4-5     -> preset moe" in text


def test_codex_gets_a_responses_provider_block_that_parses() -> None:
    text = render("codex", "http://gw:18000", PRESETS)
    config = tomllib.loads("\n".join(line for line in text.splitlines() if not line.startswith("#")))
    assert config["model"] == "dense" and config["model_provider"] == "fleet"
    assert config["model_context_window"] == 32768
    assert config["model_providers"]["fleet"] == {
        "name": "Fleet Gateway",
        "base_url": "http://gw:18000/v1",
        "wire_api": "responses",
        "env_key": "FLEET_GATEWAY_KEY",
    }


def test_opencode_gets_context_limits_from_the_catalogue() -> None:
    cards = [
        {"id": "dense", "aliases": ["coder"], "context_length": 32768, "max_tokens": 32768},
        {"id": "coder", "preset": "dense"},
    ]
    text = render("opencode", "http://gw:18000", from_catalogue(cards))
    config = json.loads(text.split("\n", 1)[1])
    model = config["provider"]["fleet"]["models"]["dense"]
    assert model["limit"] == {"context": 32768, "output": 32768}
    assert config["provider"]["fleet"]["options"]["baseURL"] == "http://gw:18000/v1"


@pytest.mark.parametrize("agent", AGENTS)
def test_every_agent_renders_from_the_routing_table(agent: str) -> None:
    text = render(agent, "http://127.0.0.1:18000", from_table(TABLE), TABLE)
    assert "127.0.0.1:18000" in text


def test_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    # No gateway listens on this port: the table is the source.
    assert (
        main(["connect", "codex", "--url", "http://127.0.0.1:9", "--routes", str(REPO / "routes.yaml")]) == 0
    )
    assert 'wire_api = "responses"' in capsys.readouterr().out


def test_an_unknown_agent_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown agent"):
        render("vim", "http://x", PRESETS)
