"""The four tools: their input schemas, their descriptions and the requests they become (pure).

The descriptions are written from the routing table each time a client lists the tools, so an
orchestrator reads which presets exist, which task goes where and how fast each one decodes, in
the table's current state. They say when not to delegate as plainly as when to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.routing.table import Table

DELEGATE, EXTRACT, LOOK, FLEET_STATUS = "delegate", "extract", "look", "fleet_status"
NAMES = (DELEGATE, EXTRACT, LOOK, FLEET_STATUS)

MAX_TOKENS = 2**31 - 1
_STRING = {"type": "string"}
_OPTIONAL_PRESET = {"type": "string", "description": "A preset name or alias; overrides the task's routing"}
_CONTEXT = {
    "type": "string",
    "description": "Inline material (files' text) the prompt is about; placed before the prompt so "
    "repeated delegations over the same file reuse the replica's prefix cache",
}

SCHEMAS: dict[str, dict[str, Any]] = {
    DELEGATE: {
        "type": "object",
        "properties": {
            "task": {"type": "string", "description": "The kind of work; a task of the routing table"},
            "prompt": {"type": "string", "description": "The instruction: what to produce"},
            "system": {"type": "string", "description": "Stable instructions, kept identical across calls"},
            "context": _CONTEXT,
            # Bounded: the request body is JSON for an engine, whose integers are 64-bit at most.
            "max_tokens": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_TOKENS,
                "description": "Cap on the answer's tokens",
            },
            "preset": _OPTIONAL_PRESET,
        },
        "required": ["task", "prompt"],
        "additionalProperties": False,
    },
    EXTRACT: {
        "type": "object",
        "properties": {
            "prompt": {"type": "string", "description": "What to extract"},
            "json_schema": {"type": "object", "description": "The JSON Schema the answer must satisfy"},
            "context": _CONTEXT,
            "preset": _OPTIONAL_PRESET,
        },
        "required": ["prompt", "json_schema"],
        "additionalProperties": False,
    },
    LOOK: {
        "type": "object",
        "properties": {
            "image": {"type": "string", "description": "The image: a data URL or bare base64 (PNG or JPEG)"},
            "prompt": {"type": "string", "description": "What to look for or describe"},
        },
        "required": ["image", "prompt"],
        "additionalProperties": False,
    },
    FLEET_STATUS: {"type": "object", "properties": {}, "additionalProperties": False},
}

DELEGATE_RESULT = {
    "type": "object",
    "properties": {
        "preset": _STRING,
        "replica": _STRING,
        "prompt_tokens": {"type": "integer"},
        "cached_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "seconds": {"type": "number"},
    },
    "required": ["preset", "replica", "prompt_tokens", "cached_tokens", "completion_tokens", "seconds"],
}


def _speed(preset: str, speeds: Mapping[str, float | None]) -> str:
    tps = speeds.get(preset)
    return f"; decodes ~{tps:.0f} tokens/s lately" if tps else ""


def _presets(table: Table, speeds: Mapping[str, float | None]) -> str:
    tasks_of: dict[str, list[str]] = {}
    for task, target in table.tasks.items():
        tasks_of.setdefault(target, []).append(task)
    lines = []
    for name, preset in table.presets.items():
        traits = []
        if preset.vision:
            traits.append("reads images")
        if preset.thinking:
            traits.append("thinks before answering (slower, for hard problems)")
        tasks = ", ".join(sorted(tasks_of.get(name, []))) or "none"
        about = f" {preset.description.rstrip('.')}." if preset.description else ""
        lines.append(
            f"- {name} ({preset.served_model}):{about} Tasks: {tasks}"
            f"{'; ' if traits else ''}{', '.join(traits)}{_speed(name, speeds)}"
        )
    return "\n".join(lines)


def descriptions(table: Table, speeds: Mapping[str, float | None]) -> dict[str, str]:
    """The MCP tools' descriptions, written from the routing table and the presets' measured decode
    speeds: what each tool is for and not for, the tasks, which preset extraction and images run on,
    and a line per preset. The server calls it each time it lists the tools."""
    presets = _presets(table, speeds)
    tasks = ", ".join(sorted(table.tasks)) or "none"
    extract_to = table.tasks.get("extract", table.default)
    vision = table.images or "none"
    return {
        DELEGATE: (
            "Hand one bounded piece of work to the local model fleet and get its answer as text: "
            "summarise or explain given material, draft code or tests from a clear specification, "
            "rewrite, translate, classify. The local models are fast and cost nothing per token but "
            "are weaker than you: do NOT delegate the reasoning, planning or judgement the task depends "
            "on, work that needs tools or files the fleet cannot see, or anything where a subtle error "
            "would be expensive. Give everything the model needs in `context` (it sees nothing else), "
            "keep `system` identical across calls so the prefix cache applies, and check the answer. "
            f"Tasks: {tasks}. Presets:\n{presets}"
        ),
        EXTRACT: (
            "Extract structured data from text into JSON that satisfies `json_schema` (the engines' "
            "schema-constrained decoding; the result is validated before it is returned, as structured "
            f"content). Runs on the '{extract_to}' preset unless `preset` is given. Use it for fields, "
            "lists, labels and tables from documents or logs; not for judgements that need reasoning."
        ),
        LOOK: (
            "Ask the fleet's vision model about an image (screenshot, diagram, photo): describe it, read "
            f"its text, find an element. Runs on the '{vision}' preset. Pass the image as a data URL or "
            "base64; keep the prompt specific."
        ),
        FLEET_STATUS: (
            "The fleet's presets as structured content: name, aliases, tasks, capabilities, context "
            "length, whether a replica is ready (loaded), queue length, requests in flight and measured "
            "decode speed. Read it to "
            "decide which preset fits before delegating large or many requests."
        ),
    }


def _user(prompt: str, context: str | None) -> str:
    # Context first, the prompt after it: repeated calls over one file share the longest prefix.
    return f"{context}\n\n{prompt}" if context else prompt


def _messages(system: str | None, prompt: str, context: str | None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": _user(prompt, context)})
    return messages


def delegate_body(args: Mapping[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": _messages(args.get("system"), args["prompt"], args.get("context")),
    }
    if args.get("preset"):
        body["model"] = args["preset"]
    else:
        body["model"], body["task"] = "auto", args["task"]
    if args.get("max_tokens") is not None:
        body["max_tokens"] = args["max_tokens"]
    return body


EXTRACT_SYSTEM = "Extract the requested data. Answer with one JSON value that satisfies the given schema."


def extract_body(args: Mapping[str, Any], table: Table) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": _messages(EXTRACT_SYSTEM, args["prompt"], args.get("context")),
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "extract", "schema": args["json_schema"], "strict": True},
        },
    }
    if args.get("preset"):
        body["model"] = args["preset"]
    elif "extract" in table.tasks:
        body["model"], body["task"] = "auto", "extract"
    else:
        body["model"] = "auto"
    return body


def image_url(image: str) -> str:
    if image.startswith("data:"):
        return image
    kind = "image/jpeg" if image.startswith("/9j/") else "image/png"
    return f"data:{kind};base64,{image}"


def look_body(args: Mapping[str, Any]) -> dict[str, Any]:
    # Images route to the table's vision preset by themselves (routing `images`).
    content = [
        {"type": "image_url", "image_url": {"url": image_url(args["image"])}},
        {"type": "text", "text": args["prompt"]},
    ]
    return {"model": "auto", "messages": [{"role": "user", "content": content}]}
