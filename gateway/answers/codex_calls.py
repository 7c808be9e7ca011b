"""Codex's tool calls on their way back: what the engine called as a plain function, told to Codex
in the form it declared the tool in.

Codex declares free-form `custom` tools (its `exec` JavaScript tool, `apply_patch`) and groups
function tools in `namespace`s; local engines know only function tools with JSON arguments, so the
request goes up with each custom tool as a function taking one string `input` and each namespaced
tool as `namespace__name` (dialects/codex_tools.py). Here the engine's `function_call` items come
back as Codex expects them: a `custom_tool_call` with its raw `input` (streamed as
`response.custom_tool_call_input.delta` and `.done`), or a `function_call` with its own `name` and
its `namespace`. Whole answers and streams alike; everything else passes untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.answers.changes import Change
from gateway.answers.events import Event, make

SEPARATOR = "__"  # namespace__tool: what the engine sees of a tool in a namespace
DEFAULT_NAMESPACE = "functions"  # Codex's own top-level group: its tools keep their bare names


@dataclass
class ToolNames:
    """How the request's tool names were changed for the engine, to undo on the way back."""

    custom: set[str] = field(default_factory=set)  # engine names of custom (free-form) tools
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # engine name -> (namespace, name)

    def __bool__(self) -> bool:
        return bool(self.custom or self.namespaced)


def custom_input(arguments: Any) -> str:
    """The raw input of a custom tool from the engine's JSON arguments (`{"input": ...}`); what is
    not such an object is taken as the input itself."""
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
        if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
            return str(parsed["input"])
        return arguments
    return ""


class CodexCalls(Change):
    """Turns the engine's function calls back into Codex's custom and namespaced tool calls."""

    name = "codex_calls"
    markers: tuple[bytes, ...] | None = (
        b'"function_call"',
        b"function_call_arguments",
        b'"response.completed"',
        b'"response.incomplete"',
        b'"response.failed"',
    )

    def __init__(self, names: ToolNames) -> None:
        self.names = names
        self.custom_items: set[str] = set()  # ids of the stream's items that are custom calls

    def item(self, item: dict[str, Any]) -> dict[str, Any]:
        """One output item as Codex declared its tool."""
        if item.get("type") != "function_call" or not isinstance(item.get("name"), str):
            return item
        name = item["name"]
        if name in self.names.custom:
            changed = {k: v for k, v in item.items() if k not in ("arguments", "name", "type")}
            bare = self.names.namespaced.get(name, (DEFAULT_NAMESPACE, name))[1]
            return {
                "type": "custom_tool_call",
                **changed,
                "name": bare,
                "input": custom_input(item.get("arguments")),
            }
        if name in self.names.namespaced:
            namespace, bare = self.names.namespaced[name]
            return {**item, "name": bare, "namespace": namespace}
        return item

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        output = payload.get("output")
        if not isinstance(output, list):
            return payload
        return {**payload, "output": [self.item(i) if isinstance(i, dict) else i for i in output]}

    def stream(self, event: Event) -> list[Event]:
        """Rewrites one Responses stream event: call items named for Codex, a custom call's argument
        events dropped and its input sent whole just before its item is done, and the final
        response's output renamed too; every other event is returned as it came."""
        data = event.data
        if data is None:
            return [event]
        kind = data.get("type")
        if kind in ("response.output_item.added", "response.output_item.done") and isinstance(
            data.get("item"), dict
        ):
            item = self.item(data["item"])
            if item is data["item"]:
                return [event]
            out: list[Event] = []
            if item.get("type") == "custom_tool_call":
                if kind == "response.output_item.added":
                    self.custom_items.add(str(item.get("id")))
                else:
                    out += self._input_events(data, item)
            event.data = {**data, "item": item}
            return [*out, event.changed()]
        if kind in ("response.function_call_arguments.delta", "response.function_call_arguments.done"):
            # A custom call's input goes out whole, just before its item is done.
            return [] if str(data.get("item_id")) in self.custom_items else [event]
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            response = data.get("response")
            if isinstance(response, dict):
                event.data = {**data, "response": self.whole(response)}
                return [event.changed()]
        return [event]

    def _input_events(self, done: dict[str, Any], item: dict[str, Any]) -> list[Event]:
        base = {"item_id": item.get("id"), "output_index": done.get("output_index", 0)}
        text = str(item.get("input", ""))
        return [
            make({"type": "response.custom_tool_call_input.delta", **base, "delta": text}),
            make({"type": "response.custom_tool_call_input.done", **base, "input": text}),
        ]
