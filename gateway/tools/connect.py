"""`fleet-gateway connect AGENT`: the exact configuration that points a coding agent at this
gateway, with the model mapping the routing table gives its default names and the context settings
the agent really honours (docs/agents.md, "What the agents expect (verified)").

Pure rendering from a list of presets (name, aliases, context, budget); the CLI reads them from a
running gateway's catalogue when it answers, else from the routing table (no context then).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.table import Table

AGENTS = ("claude", "codex", "opencode", "aider", "continue")
KEY_VARIABLE = "FLEET_GATEWAY_KEY"
KEY_PLACEHOLDER = "<your gateway key, or any text when the gateway has no keys>"
# What Claude Code 2.1.332 sends unless told otherwise: its default (opus) model, the sonnet one
# (`--model sonnet`, subagents) and the haiku one (background work); the table's patterns decide
# where they go.
CLAUDE_NAMES = ("claude-opus-5-5", "claude-sonnet-5-5", "claude-haiku-5-5")
# Claude Code reads CLAUDE_CODE_AUTO_COMPACT_WINDOW only from 100k tokens up: a smaller value is
# taken as 100k (it warns "treats it as the 100k minimum").
CLAUDE_AUTO_COMPACT_FLOOR = 100_000
# Claude Code compacts at window - min(output budget, 20000) - 13000 tokens (measured: with a 32768
# window and a 4096 budget, 16000 tokens compact and 12000 do not).
CLAUDE_OUTPUT_RESERVE_CAP = 20_000
CLAUDE_COMPACT_BUFFER = 13_000
# Claude Code's own system prompt and tools take 15k-20k tokens; a compaction point below this
# leaves no room for a conversation, and it compacts on every turn ("Autocompact is thrashing",
# measured on a 32k preset). Below it the gateway's overflow answer drives compaction instead.
CLAUDE_LEAST_COMPACT_POINT = 28_000
# Codex 0.171 compacts at model_auto_compact_token_limit, capped at 90 % of model_context_window
# (and at 90 % when no limit is set): a limit above that changes nothing.
CODEX_COMPACT_SHARE = 0.9


@dataclass(frozen=True)
class PresetInfo:
    """What `connect` needs of a preset: its names, the replicas' context, its token budget."""

    name: str
    aliases: tuple[str, ...]
    context: int | None
    max_tokens: int


def from_table(table: Table) -> list[PresetInfo]:
    return [PresetInfo(p.name, p.aliases, None, p.max_tokens) for p in table.presets.values()]


def from_catalogue(cards: Sequence[dict[str, object]]) -> list[PresetInfo]:
    """The presets from a running gateway's `/v1/models` cards, with their replicas' context
    lengths; alias cards are skipped, and a missing budget counts as 8192 tokens."""
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
                context if isinstance(context, int) and context > 0 else None,
                budget if isinstance(budget, int) and budget > 0 else 8192,
            )
        )
    return found


def output_budget(preset: PresetInfo) -> int:
    """The answer budget to give an agent: an eighth of the context, at least 1024 tokens and
    never above the preset's own budget, so that the prompt keeps most of a small window."""
    if preset.context is None:
        return preset.max_tokens
    return min(preset.max_tokens, max(1024, preset.context // 8))


def claude_compact_threshold(context: int, output: int) -> int:
    return context - min(output, CLAUDE_OUTPUT_RESERVE_CAP) - CLAUDE_COMPACT_BUFFER


def codex_compact_limit(context: int) -> int:
    return int(context * CODEX_COMPACT_SHARE)


def render(agent: str, url: str, presets: Sequence[PresetInfo], table: Table | None = None) -> str:
    url = url.rstrip("/")
    if agent == "claude":
        return _claude(url, presets, table)
    if agent == "codex":
        return _codex(url, presets)
    if agent == "opencode":
        return _opencode(url, presets)
    if agent == "aider":
        return _aider(url, presets)
    if agent == "continue":
        return _continue(url, presets)
    raise ValueError(f"unknown agent '{agent}'; one of {', '.join(AGENTS)}")


def _first(presets: Sequence[PresetInfo]) -> PresetInfo:
    return presets[0] if presets else PresetInfo("coder", (), None, 8192)


def _preset_for(name: str, presets: Sequence[PresetInfo], table: Table | None) -> PresetInfo:
    """The preset the routing table sends `name` to; the first preset when it cannot tell."""
    hit = table.lookup(name) if table is not None else None
    for preset in presets:
        if hit is not None and preset.name == hit[0]:
            return preset
    return _first(presets)


def _mapping(table: Table | None, names: Sequence[str]) -> list[str]:
    if table is None:
        return []
    lines = []
    for name in names:
        hit = table.lookup(name)
        lines.append(f"#   {name:<20} -> preset {hit[0] if hit else '(none)'}")
    return lines


def _claude(url: str, presets: Sequence[PresetInfo], table: Table | None) -> str:
    main = _preset_for(CLAUDE_NAMES[0], presets, table)
    sonnet = _preset_for(CLAUDE_NAMES[1], presets, table)
    small = _preset_for(CLAUDE_NAMES[2], presets, table)
    used = list({p.name: p for p in (main, sonnet, small)}.values())
    lines = [
        "# Claude Code speaks the Anthropic Messages API (/v1/messages); the gateway serves it.",
        f"export ANTHROPIC_BASE_URL={url}",
        f"export ANTHROPIC_AUTH_TOKEN='{KEY_PLACEHOLDER}'",
        "# Keep Claude Code from calling Anthropic's own services for telemetry and updates:",
        "export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
        "# Its own model names reach these presets through the routing table:",
        *_mapping(table, CLAUDE_NAMES),
    ]
    known = [p for p in used if p.context is not None]
    if len(known) == len(used):
        context = min(p.context or 0 for p in known)
        point = claude_compact_threshold(context, min(output_budget(p) for p in known))
        if point < CLAUDE_LEAST_COMPACT_POINT:
            lines += [
                f"# At a {context}-token context Claude Code's own compaction point ({point} tokens) would",
                "# fall inside its own prompt and tools (15k-20k tokens), and it would compact on every",
                "# turn. So no window is set: it keeps its own names, and compacts when the gateway",
                "# answers 'prompt is too long' (docs/agents.md). 64k tokens or more suit Claude Code.",
                "claude",
            ]
            return "\n".join(lines)
    lines += [
        "# But for its own names (claude-opus-5-5, claude-sonnet-4-6-anything, ...) Claude Code",
        "# assumes Anthropic's window (200k to 1M) and ignores CLAUDE_CODE_MAX_CONTEXT_TOKENS, so it",
        "# would not compact before a local replica's context is full. A name it does not know,",
        "# such as the preset's own, takes the window from CLAUDE_CODE_MAX_CONTEXT_TOKENS:",
        f"export ANTHROPIC_MODEL={main.name}",
        f"export ANTHROPIC_DEFAULT_OPUS_MODEL={main.name}",
        f"export ANTHROPIC_DEFAULT_SONNET_MODEL={sonnet.name}",
        f"export ANTHROPIC_DEFAULT_HAIKU_MODEL={small.name}",
        f"export ANTHROPIC_SMALL_FAST_MODEL={small.name}",
        "# Without this the default 'opus[1m]' keeps a 1M window whatever the variables say:",
        "export CLAUDE_CODE_DISABLE_1M_CONTEXT=1",
    ]
    claude_named = [p.name for p in used if p.name.casefold().startswith("claude")]
    if claude_named:
        lines.append(
            f"# Warning: {', '.join(claude_named)} may read as a Claude model name; if so Claude Code"
            " ignores the window below (rename the preset)."
        )
    if len(known) < len(used):
        lines += [
            "# The replicas' context is unknown (no running gateway answered): rerun with --url, or",
            "# set CLAUDE_CODE_MAX_CONTEXT_TOKENS to the smallest replica context and",
            "# CLAUDE_CODE_MAX_OUTPUT_TOKENS to about an eighth of it.",
            "claude",
        ]
        return "\n".join(lines)
    # One variable serves every model Claude Code does not know: the smallest window wins.
    smallest = min(known, key=lambda p: p.context or 0)
    context = smallest.context or 0
    output = min(output_budget(p) for p in known)
    threshold = claude_compact_threshold(context, output)
    contexts = ", ".join(f"{p.name} {p.context}" for p in known)
    lines += [
        f"# Context window (the smallest of {contexts}):",
        f"export CLAUDE_CODE_MAX_CONTEXT_TOKENS={context}",
        "# Answer budget (max_tokens); it also sets where compaction starts:",
        f"export CLAUDE_CODE_MAX_OUTPUT_TOKENS={output}",
        f"# Claude Code then compacts at about {context} - {min(output, CLAUDE_OUTPUT_RESERVE_CAP)}"
        f" - {CLAUDE_COMPACT_BUFFER} = {threshold} tokens.",
    ]
    if threshold < context // 3:
        lines.append(
            "# Warning: that leaves little room; Claude Code's own prompt and tools take 15k-20k"
            " tokens, so a session may overflow before compaction can help."
        )
    if context >= CLAUDE_AUTO_COMPACT_FLOOR:
        lines += [
            "# At this size Claude Code's own names also work: instead of the model variables set",
            f"#   export CLAUDE_CODE_AUTO_COMPACT_WINDOW={context}",
            f"# (read only from {CLAUDE_AUTO_COMPACT_FLOOR} up; a smaller value counts as"
            f" {CLAUDE_AUTO_COMPACT_FLOOR}).",
        ]
    lines.append("claude")
    return "\n".join(lines)


def _codex(url: str, presets: Sequence[PresetInfo]) -> str:
    main = _first(presets)
    lines = [
        "# ~/.codex/config.toml — Codex speaks only the Responses API (/v1/responses).",
        f'model = "{main.name}"',
        'model_provider = "fleet"',
    ]
    if main.context:
        lines += [
            "# Codex knows no window for a local model name; it compacts from these two keys",
            "# (the limit is capped at 90 % of the window):",
            f"model_context_window = {main.context}",
            f"model_auto_compact_token_limit = {codex_compact_limit(main.context)}",
        ]
    else:
        lines += [
            "# Context unknown (no running gateway answered): add model_context_window and",
            "# model_auto_compact_token_limit (90 % of it), or rerun with --url.",
        ]
    lines += [
        "",
        "[model_providers.fleet]",
        'name = "Fleet Gateway"',
        f'base_url = "{url}/v1"',
        'wire_api = "responses"',
        f'env_key = "{KEY_VARIABLE}"',
        "",
        f"# then: export {KEY_VARIABLE}='{KEY_PLACEHOLDER}'; codex",
        f"# presets: {', '.join(_described(p) for p in presets)}",
    ]
    return "\n".join(lines)


def _described(preset: PresetInfo) -> str:
    return f"{preset.name} ({preset.context} tokens)" if preset.context else preset.name


def _opencode(url: str, presets: Sequence[PresetInfo]) -> str:
    models: dict[str, object] = {}
    for preset in presets:
        entry: dict[str, object] = {"name": f"{preset.name} (fleet)"}
        if preset.context:
            # opencode compacts when a prompt nears context - output: the output limit must
            # leave the prompt most of the window.
            entry["limit"] = {"context": preset.context, "output": output_budget(preset)}
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
                "max_tokens": output_budget(p),
                "max_output_tokens": output_budget(p),
                "litellm_provider": "openai",
                "mode": "chat",
            }
            for p in with_context
        }
        lines += [
            "# .aider.model.metadata.json (aider reads the window and budget from here)",
            json.dumps(metadata, indent=2),
        ]
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
            lines += [
                "    defaultCompletionOptions:",
                f"      contextLength: {preset.context}",
                f"      maxTokens: {output_budget(preset)}",
            ]
    return "\n".join(lines)
