"""Scripted tool loops: a marker in the last user turn asks for a tool call, a tool result is echoed back.

``[[tool NAME ARGS_JSON]]`` (e.g. ``[[tool Bash {"command": "echo hi"}]]``; ARGS_JSON may be left out for
``{}``) in the last user turn makes the reply a call of tool NAME with those arguments, when the request
offers a tool of that name. When the conversation ends with a tool result, the reply is text that starts
``tool result: `` and goes on with the result's first 200 characters, so a test can see the loop closed.
Every dialect is converted to chat messages first, so this module only ever sees those.

With ``SimConfig.summaries`` on, an agent's compaction request (the conversation plus a user message that
asks for a summary in the agent's own words) is answered with a ``<summary>`` block instead, so that a
session can compact and go on. When the conversation's last marker was not yet answered by an echo (the
agent compacted in the middle of a tool round), the summary restates that marker as the step left to do:
an agent that resumes from the summary alone then makes the call again, as a model would.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.types import Json

MARKER = "[[tool "
ECHO = "tool result: "
ECHO_CHARS = 200
# How the agents ask for a summary when they compact: Claude Code 2.1.332 wants "an <analysis> block
# followed by a <summary> block" (and takes a reply without <summary> for a failed compaction), Codex
# 0.171.0 asks for "a handoff summary for another LLM". The agents' fixtures hold the whole requests.
SUMMARY_CUES = ("<summary> block", "handoff summary")
SUMMARY = "<summary>"
_NAME = re.compile(r"[^\s\]]+")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Script:
    """Either a tool call (name and JSON arguments) or the text that echoes a tool result."""

    name: str | None = None
    arguments: str = "{}"
    echo: str | None = None


def text_of(content: Any) -> str:
    """The text of a chat message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return "" if content is None else str(content)


def find_marker(text: str) -> tuple[str, str] | None:
    """(tool name, arguments as a JSON string) of the first well-formed marker in ``text``."""
    start = text.find(MARKER)
    while start >= 0:
        pos = start + len(MARKER)
        name = _NAME.match(text, pos)
        if name is not None:
            pos = name.end()
            while pos < len(text) and text[pos].isspace():
                pos += 1
            args: Any = {}
            if not text.startswith("]]", pos):
                try:
                    args, pos = _DECODER.raw_decode(text, pos)
                except ValueError:
                    args = None
                while pos < len(text) and text[pos].isspace():
                    pos += 1
            if isinstance(args, dict) and text.startswith("]]", pos):
                return name.group(), json.dumps(args, ensure_ascii=False)
        start = text.find(MARKER, start + 1)
    return None


def strip_markers(text: str) -> str:
    """The text without its markers' own words (so "[[tool X]]" alone does not read as "call a tool")."""
    return text.replace(MARKER, "[[ ") if MARKER in text else text


def _tool_names(tools: list[Any]) -> set[str]:
    names = set()
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def detect(messages: list[Json], tools: list[Any], tool_choice: Any) -> Script | None:
    """What the conversation scripts, if anything (a forced tool_choice wins over an echo)."""
    if not messages:
        return None
    # The turn since the last assistant message: Claude Code sends its tool result together with
    # text blocks (reminders) in one user message, which arrives here as a tool message and a
    # user message after it.
    turn = messages[_after_last_assistant(messages) :]
    results = [m for m in turn if m.get("role") == "tool"]
    if results:
        if tool_choice == "required" or isinstance(tool_choice, dict):
            return None
        return Script(echo=ECHO + text_of(results[-1].get("content"))[:ECHO_CHARS])
    if tool_choice == "none":
        return None
    # Every user message of the turn: an agent may put more after its prompt (Claude Code's
    # environment block, sent as a system message the gateway turns into a user one).
    users = [m for m in turn if m.get("role") == "user"]
    found = next((f for f in (find_marker(text_of(m.get("content"))) for m in reversed(users)) if f), None)
    if found is None or found[0] not in _tool_names(tools):
        return None
    return Script(name=found[0], arguments=found[1])


def summary(messages: list[Json]) -> Script | None:
    """The summary an agent's compaction request asks for, or None when the turn asks for none.

    The ask is read in the turn being answered (since the last assistant message) only: the agents put
    it there, and a summary that an earlier compaction left in the history is no new ask."""
    turn = messages[_after_last_assistant(messages) :]
    for message in turn:
        if message.get("role") != "user":
            continue
        text = text_of(message.get("content")).casefold()
        if any(cue.casefold() in text for cue in SUMMARY_CUES):
            earlier = _after_last_assistant(messages)
            pending = _pending(messages[:earlier])
            step = f" Next: {MARKER}{pending[0]} {pending[1]}]]" if pending else ""
            return Script(echo=f"{SUMMARY}Compacted {earlier} earlier messages.{step}</summary>")
    return None


def _pending(history: list[Json]) -> tuple[str, str] | None:
    """The latest marker of the history's user messages, unless the last answer already echoed a
    tool's result (the step was done)."""
    answers = [m for m in history if m.get("role") == "assistant"]
    if answers and text_of(answers[-1].get("content")).startswith(ECHO):
        return None
    users = (text_of(m.get("content")) for m in reversed(history) if m.get("role") == "user")
    return next((found for found in map(find_marker, users) if found), None)


def _after_last_assistant(messages: list[Json]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "assistant":
            return index + 1
    return 0


def schema_instance(schema: Any) -> Any:
    """A small value that satisfies a JSON Schema's common keywords: what the simulator answers to a
    `response_format` of type `json_schema`, as the engines' constrained decoding would."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return schema_instance(schema[key][0])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties")
        if not isinstance(props, dict):
            return {}
        return {name: schema_instance(sub) for name, sub in props.items()}
    if kind == "array":
        return [schema_instance(schema.get("items", {}))] * int(schema.get("minItems", 1) or 0)
    if kind == "string":
        return "x" * int(schema.get("minLength", 4) or 0)
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    if kind == "boolean":
        return True
    return None


def structured(body: Json) -> Script | None:
    """The echo plan for a request with a JSON-schema `response_format`, else None."""
    form = body.get("response_format")
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        return None
    spec = form.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return Script(echo=json.dumps(schema_instance(schema), separators=(",", ":")))
