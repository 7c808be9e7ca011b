import json
import tomllib
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.routing.table import load_table
from gateway.tools.connect import (
    AGENTS,
    PresetInfo,
    claude_compact_threshold,
    from_catalogue,
    from_table,
    output_budget,
    render,
)

REPO = Path(__file__).resolve().parents[2]
TABLE = load_table(REPO / "routes.yaml")
PRESETS = [PresetInfo("dense", ("coder",), 32768, 32768), PresetInfo("moe", (), None, 8192)]
# The shipped table sends Claude Code's opus and sonnet names to dense, haiku to moe.
SMALL_FLEET = [PresetInfo("dense", ("coder",), 32768, 32768), PresetInfo("moe", (), 65536, 8192)]
MID_FLEET = [PresetInfo("dense", ("coder",), 65536, 32768), PresetInfo("moe", (), 131072, 8192)]
LARGE_FLEET = [PresetInfo("dense", ("coder",), 131072, 32768), PresetInfo("moe", (), 262144, 8192)]


def exports(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            found[name] = value
    return found


def test_claude_code_gets_its_environment_and_the_shipped_mapping() -> None:
    text = render("claude", "http://gw:18000/", PRESETS, TABLE)
    assert "export ANTHROPIC_BASE_URL=http://gw:18000\n" in text
    assert "claude-opus-5-5      -> preset dense" in text
    assert "claude-haiku-5-5     -> preset moe" in text


def test_claude_code_is_sent_the_preset_names_so_that_it_honours_the_context_window() -> None:
    env = exports(render("claude", "http://gw:18000", MID_FLEET, TABLE))
    assert env["ANTHROPIC_MODEL"] == "dense"
    assert env["ANTHROPIC_DEFAULT_OPUS_MODEL"] == "dense"
    assert env["ANTHROPIC_DEFAULT_SONNET_MODEL"] == "dense"
    assert env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "moe"
    assert env["ANTHROPIC_SMALL_FAST_MODEL"] == "moe"
    assert env["CLAUDE_CODE_DISABLE_1M_CONTEXT"] == "1"


def test_claude_code_gets_the_smallest_window_of_the_presets_it_uses_and_a_budget_that_fits() -> None:
    text = render("claude", "http://gw:18000", MID_FLEET, TABLE)
    env = exports(text)
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "8192"
    assert "compacts at about 65536 - 8192 - 13000 = 44344 tokens" in text
    # Below Claude Code's 100k floor the auto-compact window variable would be read as 100k.
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in text


def test_claude_code_on_a_context_too_small_for_its_own_compaction_gets_no_window() -> None:
    # At 32k Claude Code would compact at 15,672 tokens, inside its own 15k-20k prompt: thrashing.
    text = render("claude", "http://gw:18000", SMALL_FLEET, TABLE)
    env = exports(text)
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in env and "ANTHROPIC_MODEL" not in env
    assert "compacts when the gateway" in text and "(15672 tokens)" in text


def test_claude_code_at_100k_and_more_may_keep_its_own_names_with_the_auto_compact_window() -> None:
    text = render("claude", "http://gw:18000", LARGE_FLEET, TABLE)
    assert exports(text)["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "131072"
    assert "#   export CLAUDE_CODE_AUTO_COMPACT_WINDOW=131072" in text


def test_claude_code_without_a_known_context_gets_no_window_but_says_how_to_find_it() -> None:
    text = render("claude", "http://gw:18000", from_table(TABLE), TABLE)
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS=" not in "\n".join(
        line for line in text.splitlines() if line.startswith("export")
    )
    assert "rerun with --url" in text


def test_a_preset_named_like_a_claude_model_is_flagged() -> None:
    presets = [PresetInfo("claude-local", (), 65536, 8192)]
    assert "may read as a Claude model name" in render("claude", "http://gw", presets)


def test_claude_code_compaction_threshold_follows_its_measured_rule() -> None:
    assert claude_compact_threshold(32768, 4096) == 15672
    # The output reserve is capped at 20000 tokens.
    assert claude_compact_threshold(1_000_000, 128_000) == 967_000


def test_codex_gets_a_responses_provider_block_that_parses() -> None:
    text = render("codex", "http://gw:18000", PRESETS)
    config = tomllib.loads("\n".join(line for line in text.splitlines() if not line.startswith("#")))
    assert config["model"] == "dense" and config["model_provider"] == "fleet"
    assert config["model_providers"]["fleet"] == {
        "name": "Fleet Gateway",
        "base_url": "http://gw:18000/v1",
        "wire_api": "responses",
        "env_key": "FLEET_GATEWAY_KEY",
    }


def test_codex_gets_the_window_and_a_compaction_limit_at_ninety_percent() -> None:
    config = tomllib.loads(render("codex", "http://gw:18000", PRESETS))
    assert config["model_context_window"] == 32768
    assert config["model_auto_compact_token_limit"] == 29491


def test_codex_without_a_known_context_gets_no_window_keys() -> None:
    config = tomllib.loads(render("codex", "http://gw:18000", from_table(TABLE)))
    assert "model_context_window" not in config
    assert "model_auto_compact_token_limit" not in config


def test_opencode_gets_context_limits_that_leave_the_prompt_most_of_the_window() -> None:
    cards = [
        {"id": "dense", "aliases": ["coder"], "context_length": 32768, "max_tokens": 32768},
        {"id": "coder", "preset": "dense"},
    ]
    text = render("opencode", "http://gw:18000", from_catalogue(cards))
    config = json.loads(text.split("\n", 1)[1])
    model = config["provider"]["fleet"]["models"]["dense"]
    assert model["limit"] == {"context": 32768, "output": 4096}
    assert config["provider"]["fleet"]["options"]["baseURL"] == "http://gw:18000/v1"


def test_aider_and_continue_get_the_window_and_budget_they_read() -> None:
    aider = render("aider", "http://gw:18000", PRESETS)
    metadata = json.loads(
        aider.split(".aider.model.metadata.json (aider reads the window and budget from here)\n")[1]
    )
    assert metadata["openai/dense"]["max_input_tokens"] == 32768
    assert metadata["openai/dense"]["max_output_tokens"] == 4096
    assert "openai/moe" not in metadata
    text = render("continue", "http://gw:18000", PRESETS)
    assert "      contextLength: 32768\n      maxTokens: 4096" in text


def test_the_output_budget_is_an_eighth_of_the_context_within_the_presets_budget() -> None:
    assert output_budget(PresetInfo("a", (), 32768, 32768)) == 4096
    assert output_budget(PresetInfo("a", (), 131072, 8192)) == 8192
    assert output_budget(PresetInfo("a", (), 4096, 8192)) == 1024
    assert output_budget(PresetInfo("a", (), None, 8192)) == 8192


def test_a_catalogue_card_without_a_usable_context_gives_none() -> None:
    presets = from_catalogue([{"id": "dense", "context_length": None}, {"id": "moe", "context_length": 0}])
    assert [p.context for p in presets] == [None, None]


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
