"""The model catalogue agents configure themselves from: one card per preset (context length,
capabilities, aliases, readiness) and one per exact alias, in OpenAI's list shape or, for
clients that send `anthropic-version`, Anthropic's."""

from __future__ import annotations

from typing import Any

from gateway.fleet.replicas import Fleet
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


def cards(fleet: Fleet) -> list[Json]:
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
    data = [anthropic_card(c) for c in cards]
    return {
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
