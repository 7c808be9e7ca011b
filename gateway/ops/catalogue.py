"""The model catalogue agents configure themselves from: one card per preset (context length,
capabilities, aliases, readiness) and one per exact alias, in OpenAI's list shape, in Anthropic's
for clients that send `anthropic-version` (Claude Code's gateway discovery), or in Codex's model
catalogue for `?client_version=` (docs/agents.md, "What the agents expect (verified)")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from gateway.fleet.replicas import Fleet, Pool
from gateway.routing.table import Preset
from gateway.types import Json


def capabilities(preset: Preset) -> list[str]:
    found = ["chat", "tools"]
    if preset.thinking:
        found.append("thinking")
    for name in ("vision", "embeddings", "rerank"):
        if getattr(preset, name):
            found.append(name)
    return found


def context_length(fleet: Fleet, preset: Preset) -> int | None:
    # The smallest replica's context: a request sized for it fits on every replica.
    known = [r.context for r in fleet.pools[preset.name].replicas if r.context]
    return min(known) if known else None


def preset_card(fleet: Fleet, preset: Preset) -> Json:
    return {
        "id": preset.name,
        "object": "model",
        "created": 0,
        "owned_by": "fleet-gateway",
        "served_model": preset.served_model,
        "aliases": list(preset.aliases),
        "vision": preset.vision,
        "capabilities": capabilities(preset),
        "context_length": context_length(fleet, preset),
        "max_tokens": preset.max_tokens,
        "ready": fleet.pools[preset.name].ready(),
    }


def preset_view(fleet: Fleet, pool: Pool) -> Json:
    """What every view of a preset shows (the status page, MCP's fleet_status): its names, what it
    can do, its context, and how busy it is now."""
    preset = pool.preset
    return {
        "name": preset.name,
        "served_model": preset.served_model,
        "aliases": list(preset.aliases),
        "capabilities": capabilities(preset),
        "context_length": context_length(fleet, preset),
        "ready": pool.ready(),
        "queued": pool.queued,
        "in_flight": sum(r.in_flight for r in pool.replicas),
    }


def cards(fleet: Fleet) -> list[Json]:
    """The `/v1/models` list: each preset's card, then a short card per exact alias naming its
    preset (patterns are left out, since no client can list them)."""
    data = []
    for preset in fleet.table.presets.values():
        data.append(preset_card(fleet, preset))
        for alias in preset.aliases:
            if "*" in alias or "?" in alias:
                continue  # a pattern is not a model a client can list; the preset card shows it
            data.append(
                {
                    "id": alias,
                    "object": "model",
                    "created": 0,
                    "owned_by": "fleet-gateway",
                    "preset": preset.name,
                }
            )
    return data


def card(fleet: Fleet, name: str) -> Json | None:
    """`GET /v1/models/{name}`: any name the routing table resolves, with its preset's card."""
    hit = fleet.table.lookup(name)
    if hit is None:
        return None
    preset = fleet.table.presets[hit[0]]
    found = preset_card(fleet, preset)
    return {**found, "id": name, "preset": preset.name}


def anthropic_card(card: Json) -> Json:
    return {
        "type": "model",
        "id": card["id"],
        "display_name": f"{card.get('preset', card['id'])} (fleet-gateway)",
        "created_at": "1970-01-01T00:00:00Z",
    }


def anthropic_list(cards: list[Json]) -> dict[str, Any]:
    """Anthropic's model list. Claude Code 2.1.332 (CLAUDE_CODE_ENABLE_GATEWAY_MODEL_DISCOVERY)
    asks `GET /v1/models?limit=1000` with `anthropic-version`; it rejects the whole list unless
    `data` holds objects with a string `id` (`display_name` a string when present), keeps only ids
    that contain "claude" or "anthropic" for its /model picker, and reads no context length."""
    data = [anthropic_card(c) for c in cards]
    return {
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


Shape = Literal["openai", "anthropic", "codex"]


def shape(query: Mapping[str, str], headers: Mapping[str, str]) -> Shape:
    """Which list `GET /v1/models` answers with. Codex 0.171 asks `?client_version=0.171.0` with no
    `anthropic-version` header; Claude Code's discovery sends `anthropic-version`."""
    if "client_version" in query:
        return "codex"
    if "anthropic-version" in headers:
        return "anthropic"
    return "openai"


def listing(cards: list[Json], chosen: Shape, codex_instructions: str | None = None) -> dict[str, Any]:
    """The answer to `GET /v1/models` in the chosen shape. Codex's catalogue replaces Codex's own
    base prompt with `codex_instructions`; without them Codex gets the OpenAI list, fails to
    decode it, and keeps its own prompt and fallback metadata (the window then comes from the
    `model_context_window` key `fleet-gateway connect codex` prints), as if it had no catalogue."""
    if chosen == "codex" and codex_instructions:
        return codex_list(cards, codex_instructions)
    if chosen == "anthropic":
        return anthropic_list(cards)
    return {"object": "list", "data": cards}


# Codex 0.171 drops the whole catalogue ("failed to decode models response") when one entry
# lacks any of these (measured by removing each field of its bundled entry in turn), and then
# runs on its fallback metadata; unknown fields are ignored. It also needs the base prompt, as
# `base_instructions` or `model_messages.instructions_template`.
CODEX_REQUIRED = (
    "slug",
    "display_name",
    "priority",
    "visibility",
    "supported_in_api",
    "shell_type",
    "supported_reasoning_levels",
    "support_verbosity",
    "truncation_policy",
    "experimental_supported_tools",
)
# Codex compacts at auto_compact_token_limit, 90 % of context_window when absent (its own rule).
CODEX_COMPACT_SHARE = 0.9


def codex_model(card: Json, priority: int, instructions: str) -> Json:
    """One entry of Codex's catalogue, as its fallback metadata would have it (shell tools,
    10,000-byte tool output truncation) plus what the gateway knows: the replicas' context and
    whether the preset takes images."""
    context = card.get("context_length")
    entry: Json = {
        "slug": card["id"],
        "display_name": card["id"],
        "description": f"Fleet Gateway preset {card.get('preset', card['id'])}",
        "priority": priority,
        "visibility": "list",
        "supported_in_api": True,
        "shell_type": "shell_command",
        "supported_reasoning_levels": [],
        "support_verbosity": False,
        "truncation_policy": {"mode": "bytes", "limit": 10_000},
        "experimental_supported_tools": [],
        # Codex sends this as its first developer message in place of its own base prompt.
        "base_instructions": instructions,
        "supports_parallel_tool_calls": True,
        "input_modalities": ["text", "image"] if card.get("vision") else ["text"],
    }
    if isinstance(context, int) and context > 0:
        entry["context_window"] = context
        entry["max_context_window"] = context
        entry["auto_compact_token_limit"] = int(context * CODEX_COMPACT_SHARE)
    return entry


def codex_list(cards: list[Json], instructions: str) -> dict[str, Any]:
    """Codex's `{"models": [...]}`: every preset and exact alias under its own slug, an alias
    with its preset's context and capabilities (Codex looks metadata up by the configured name)."""
    presets = {c["id"]: c for c in cards if "preset" not in c}
    models = []
    for priority, card in enumerate(cards):
        if "preset" in card:
            preset = presets.get(card["preset"])
            if preset is None:
                continue
            card = {**preset, "id": card["id"], "preset": card["preset"]}
        models.append(codex_model(card, priority, instructions))
    return {"models": models}
