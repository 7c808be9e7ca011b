from gateway.ops.catalogue import (
    CODEX_REQUIRED,
    anthropic_list,
    codex_list,
    codex_model,
    listing,
    shape,
)
from gateway.types import Json

CARDS: list[Json] = [
    {
        "id": "dense",
        "object": "model",
        "aliases": ["coder", "claude-*opus*"],
        "vision": False,
        "capabilities": ["chat", "tools"],
        "context_length": 32768,
        "max_tokens": 8192,
        "ready": True,
    },
    {"id": "coder", "object": "model", "preset": "dense"},
    {
        "id": "vision",
        "object": "model",
        "aliases": [],
        "vision": True,
        "capabilities": ["chat", "tools", "vision"],
        "context_length": None,
        "max_tokens": 4096,
        "ready": False,
    },
]


def test_codex_asks_with_client_version_and_claude_code_with_anthropic_version() -> None:
    assert shape({"client_version": "0.171.0"}, {}) == "codex"
    assert shape({"limit": "1000"}, {"anthropic-version": "2023-06-01"}) == "anthropic"
    assert shape({}, {}) == "openai"
    # The query decides first: Codex never sends anthropic-version, and a client that sends both
    # asked for Codex's shape by name.
    assert shape({"client_version": "0.171.0"}, {"anthropic-version": "2023-06-01"}) == "codex"


def test_every_codex_entry_has_each_field_its_parser_requires() -> None:
    for entry in codex_list(CARDS, "base prompt")["models"]:
        assert set(CODEX_REQUIRED) <= set(entry)
        assert entry["base_instructions"] == "base prompt"


def test_codex_gets_the_window_and_a_compaction_limit_at_ninety_percent() -> None:
    entry = codex_model(CARDS[0], 0, "x")
    assert entry["context_window"] == 32768
    assert entry["max_context_window"] == 32768
    assert entry["auto_compact_token_limit"] == 29491
    assert entry["supports_parallel_tool_calls"] is True
    assert entry["input_modalities"] == ["text"]


def test_an_unknown_context_leaves_codex_its_own_default() -> None:
    entry = codex_model(CARDS[2], 2, "x")
    assert "context_window" not in entry and "auto_compact_token_limit" not in entry
    assert entry["input_modalities"] == ["text", "image"]


def test_an_alias_is_listed_for_codex_under_its_own_slug_with_its_presets_window() -> None:
    models = {m["slug"]: m for m in codex_list(CARDS, "x")["models"]}
    assert set(models) == {"dense", "coder", "vision"}
    assert models["coder"]["context_window"] == 32768
    assert models["coder"]["description"] == "Fleet Gateway preset dense"


def test_codex_gets_the_openai_list_when_the_gateway_has_no_base_prompt_to_give() -> None:
    # Codex then fails to decode it and keeps its own prompt and fallback metadata.
    assert listing(CARDS, "codex") == {"object": "list", "data": CARDS}
    assert "models" in listing(CARDS, "codex", "base prompt")


def test_the_anthropic_list_has_the_fields_claude_code_reads() -> None:
    answer = listing(CARDS, "anthropic")
    assert answer == anthropic_list(CARDS)
    assert answer["has_more"] is False
    assert (answer["first_id"], answer["last_id"]) == ("dense", "vision")
    for item in answer["data"]:
        assert set(item) == {"type", "id", "display_name", "created_at"}
        assert isinstance(item["id"], str) and isinstance(item["display_name"], str)


def test_the_openai_list_is_the_cards() -> None:
    assert listing(CARDS, "openai") == {"object": "list", "data": CARDS}
