"""`fleet-gateway connect AGENT`: the exact configuration that points a coding agent at this
gateway, with the model mapping the routing table gives its default names.

Pure rendering from a list of presets (name, aliases, context, budget); the CLI reads them from a
running gateway's catalogue when it answers, else from the routing table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.table import Table

AGENTS = ("claude", "codex", "opencode", "aider", "continue")
KEY_VARIABLE = "FLEET_GATEWAY_KEY"
KEY_PLACEHOLDER = "<your gateway key, or any text when the gateway has no keys>"
# The names each agent sends unless told otherwise; the table's patterns decide where they go.
CLAUDE_NAMES = ("claude-opus-4-8", "claude-sonnet-4-6", "claude-haiku-4-5")


@dataclass(frozen=True)
class PresetInfo:
    name: str
    aliases: tuple[str, ...]
    context: int | None
    max_tokens: int


def from_table(table: Table) -> list[PresetInfo]:
    return [PresetInfo(p.name, p.aliases, None, p.max_tokens) for p in table.presets.values()]


def from_catalogue(cards: Sequence[dict[str, object]]) -> list[PresetInfo]:
    found = []
    for card in cards:
        if "preset" in card or not isinstance(card.get("id"), str):
            continue  # alias cards
        aliases = card.get("aliases")
        context = card.get("context_length")
        budget = card.get("max_tokens")
        found.append(
            PresetInfo(
                str(card["id"]),
                tuple(str(a) for a in aliases) if isinstance(aliases, list) else (),
                context if isinstance(context, int) else None,
                budget if isinstance(budget, int) else 8192,
            )
        )
    return found


def render(agent: str, url: str, presets: Sequence[PresetInfo], table: Table | None = None) -> str:
    url = url.rstrip("/")
    if agent == "claude":
        return _claude(url, table)
    if agent == "codex":
        return _codex(url, presets)
    if agent == "opencode":
        return _opencode(url, presets)
    if agent == "aider":
        return _aider(url, presets)
    if agent == "continue":
        return _continue(url, presets)
    raise ValueError(f"unknown agent '{agent}'; one of {', '.join(AGENTS)}")


def _mapping(table: Table | None, names: Sequence[str]) -> list[str]:
    if table is None:
        return []
    lines = []
    for name in names:
        hit = table.lookup(name)
        lines.append(f"#   {name:<20} -> preset {hit[0] if hit else '(none: set ANTHROPIC_MODEL)'}")
    return lines


def _claude(url: str, table: Table | None) -> str:
    return "\n".join(
        [
            "# Claude Code speaks the Anthropic Messages API (/v1/messages); the gateway serves it.",
            f"export ANTHROPIC_BASE_URL={url}",
            f"export ANTHROPIC_AUTH_TOKEN='{KEY_PLACEHOLDER}'",
            "# Keep Claude Code from calling Anthropic's own services for telemetry and updates:",
            "export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
            "# Its default model names reach these presets (aliases in routes.yaml; pick another",
            "# with ANTHROPIC_MODEL / ANTHROPIC_SMALL_FAST_MODEL set to any preset or alias):",
            *_mapping(table, CLAUDE_NAMES),
            "claude",
        ]
    )


def _first(presets: Sequence[PresetInfo]) -> PresetInfo:
    return presets[0] if presets else PresetInfo("coder", (), None, 8192)


def _codex(url: str, presets: Sequence[PresetInfo]) -> str:
    main = _first(presets)
    lines = [
        "# ~/.codex/config.toml — Codex speaks only the Responses API (/v1/responses).",
        f'model = "{main.name}"',
        'model_provider = "fleet"',
    ]
    if main.context:
        lines.append(f"model_context_window = {main.context}")
    lines += [
        "",
        "[model_providers.fleet]",
        'name = "Fleet Gateway"',
        f'base_url = "{url}/v1"',
        'wire_api = "responses"',
        f'env_key = "{KEY_VARIABLE}"',
        "",
        f"# then: export {KEY_VARIABLE}='{KEY_PLACEHOLDER}'; codex",
        f"# presets: {', '.join(p.name for p in presets)}",
    ]
    return "\n".join(lines)


def _opencode(url: str, presets: Sequence[PresetInfo]) -> str:
    models: dict[str, object] = {}
    for preset in presets:
        entry: dict[str, object] = {"name": f"{preset.name} (fleet)"}
        if preset.context:
            entry["limit"] = {"context": preset.context, "output": min(preset.max_tokens, preset.context)}
        models[preset.name] = entry
    config = {
        "provider": {
            "fleet": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Fleet Gateway",
                "options": {"baseURL": f"{url}/v1", "apiKey": "{env:" + KEY_VARIABLE + "}"},
                "models": models,
            }
        },
        "model": f"fleet/{_first(presets).name}",
    }
    return "// opencode.json\n" + json.dumps(config, indent=2)


def _aider(url: str, presets: Sequence[PresetInfo]) -> str:
    main = _first(presets)
    lines = [
        f"export OPENAI_API_BASE={url}/v1",
        f"export OPENAI_API_KEY='{KEY_PLACEHOLDER}'",
        f"aider --model openai/{main.name}",
    ]
    with_context = [p for p in presets if p.context]
    if with_context:
        metadata = {
            f"openai/{p.name}": {
                "max_input_tokens": p.context,
                "max_output_tokens": min(p.max_tokens, p.context or 0),
            }
            for p in with_context
        }
        lines += ["# .aider.model.metadata.json", json.dumps(metadata, indent=2)]
    return "\n".join(lines)


def _continue(url: str, presets: Sequence[PresetInfo]) -> str:
    lines = ["# ~/.continue/config.yaml", "models:"]
    for preset in presets:
        lines += [
            f"  - name: {preset.name} (fleet)",
            "    provider: openai",
            f"    model: {preset.name}",
            f"    apiBase: {url}/v1",
            f"    apiKey: {KEY_PLACEHOLDER}",
        ]
        if preset.context:
            lines.append(f"    defaultCompletionOptions: {{contextLength: {preset.context}}}")
    return "\n".join(lines)
