"""Codex's requests on local engines: its whole tool surface on engines that know only function
tools (the `codex_tools` fix), and its replayed reasoning in a form they accept (`reasoning_replay`).

With its default model name Codex sends its tools as `namespace` groups holding free-form `custom`
tools (`exec`: JavaScript that calls every other tool; `apply_patch`) beside function tools; with a
preset's alias it sends function tools, a `namespace` group and `web_search`. Neither engine the
tests install knows custom tools or namespaces (and dropping `exec` leaves Codex unable to run a
command). So, on the way up:

- a custom tool becomes a function with one string parameter `input`; its description says the
  input is raw text, and its Lark grammar (where it has one) goes into the description, since
  neither engine takes a grammar for a tool's arguments;
- a namespace's tools are lifted out, named `namespace__tool` (Codex's own `functions` group keeps
  the bare names, as Codex itself calls them);
- the history follows: a `custom_tool_call` goes up as the `function_call` the engine would have
  made, its `custom_tool_call_output` as a `function_call_output` (text parts joined), and a
  namespaced `function_call` under its flattened name.

The answer's calls are turned back by answers/codex_calls.py. A request without custom tools or
namespaces is left as it came, byte for byte.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.answers.changes import Changes
from gateway.answers.codex_calls import DEFAULT_NAMESPACE, SEPARATOR, CodexCalls, ToolNames
from gateway.dialects.base import Note

_RAW_INPUT = (
    "\n\nCall it with one argument, `input`: the tool's raw input text, exactly as the tool "
    "expects it (not JSON, no markdown fences)."
)


def engine_name(name: str, namespace: str | None) -> str:
    return name if namespace in (None, DEFAULT_NAMESPACE) else f"{namespace}{SEPARATOR}{name}"


def _function(tool: dict[str, Any], namespace: str | None, names: ToolNames) -> dict[str, Any]:
    name = str(tool.get("name", ""))
    flat = engine_name(name, namespace)
    if flat != name:
        names.namespaced[flat] = (str(namespace), name)
    if tool.get("type") != "custom":
        return {**tool, "name": flat} if flat != name else tool
    names.custom.add(flat)
    description = str(tool.get("description") or "") + _RAW_INPUT
    form = tool.get("format")
    if isinstance(form, dict) and form.get("type") == "grammar" and isinstance(form.get("definition"), str):
        description += (
            f"\nThe input must match this {form.get('syntax', 'lark')} grammar:\n{form['definition']}"
        )
    return {
        "type": "function",
        "name": flat,
        "description": description,
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string", "description": "The tool's raw input text"}},
            "required": ["input"],
            "additionalProperties": False,
        },
    }


def _tools(tools: list[Any], names: ToolNames) -> list[Any] | None:
    if not any(isinstance(t, dict) and t.get("type") in ("custom", "namespace") for t in tools):
        return None
    out: list[Any] = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            namespace = str(tool.get("name", ""))
            out += [_function(t, namespace, names) for t in tool["tools"] if isinstance(t, dict)]
        elif kind == "custom":
            out.append(_function(tool, None, names))
        else:
            out.append(tool)
    return out


def _output_text(output: Any) -> Any:
    """A custom call's output as a function call's: its text parts joined; other parts kept."""
    if isinstance(output, list) and all(
        isinstance(p, dict) and p.get("type") == "input_text" for p in output
    ):
        return "".join(str(p.get("text", "")) for p in output)
    return output


def _history(items: list[Any]) -> list[Any] | None:
    changed: list[Any] | None = None
    for index, item in enumerate(items):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "custom_tool_call":
            name = engine_name(str(item.get("name", "")), item.get("namespace"))
            arguments = orjson.dumps({"input": str(item.get("input", ""))}).decode()
            kept = {k: v for k, v in item.items() if k not in ("type", "name", "input", "namespace")}
            new: Any = {"type": "function_call", **kept, "name": name, "arguments": arguments}
        elif kind == "custom_tool_call_output":
            kept = {k: v for k, v in item.items() if k not in ("type", "output")}
            new = {"type": "function_call_output", **kept, "output": _output_text(item.get("output"))}
        elif kind == "function_call" and item.get("namespace"):
            kept = {k: v for k, v in item.items() if k != "namespace"}
            new = {**kept, "name": engine_name(str(item.get("name", "")), item["namespace"])}
        else:
            continue
        if changed is None:
            changed = list(items)
        changed[index] = new
    return changed


def codex_tools(body: dict[str, Any], changes: Changes | None) -> list[Note]:
    """The `codex_tools` fix (see the module docstring); the answer's change goes to `changes`."""
    names = ToolNames()
    notes: list[Note] = []
    tools = body.get("tools")
    flat = _tools(tools, names) if isinstance(tools, list) else None
    if flat is not None:
        body["tools"] = flat
        notes.append(("codex_tools", f"custom_tools={len(names.custom)},namespaced={len(names.namespaced)}"))
    items = body.get("input")
    history = _history(items) if isinstance(items, list) else None
    if history is not None:
        body["input"] = history
        if not notes:
            notes.append(("codex_tools", "history=mapped"))
    if names and changes is not None:
        changes.add(CodexCalls(names))
    return notes


def reasoning_replay(body: dict[str, Any]) -> list[Note]:
    """Codex replays each earlier `reasoning` item (`include: ["reasoning.encrypted_content"]`),
    with `content` and `encrypted_content` null when the answer had none. llama-server refuses an
    item whose content is null or empty ("item['content'] is not an array"), vLLM one that carries
    `encrypted_content` ("Encrypted content is not supported"), and no local engine can read
    OpenAI's encrypted reasoning. So an item keeps only what a model can read: its text content,
    without `encrypted_content`; an item with none is left out. The same history maps to the same
    bytes on every turn, so the prefix cache is not disturbed."""
    items = body.get("input")
    if not isinstance(items, list):
        return []
    kept: list[Any] = []
    dropped = cleaned = 0
    for item in items:
        if not (isinstance(item, dict) and item.get("type") == "reasoning"):
            kept.append(item)
            continue
        content = item.get("content")
        if not (isinstance(content, list) and content):
            dropped += 1
            continue
        if "encrypted_content" in item:
            item = {k: v for k, v in item.items() if k != "encrypted_content"}
            cleaned += 1
        kept.append(item)
    if not dropped and not cleaned:
        return []
    body["input"] = kept
    return [("reasoning_replay", f"reasoning_dropped={dropped},encrypted_removed={cleaned}")]
