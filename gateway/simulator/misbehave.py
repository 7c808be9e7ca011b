"""What real models and misconfigured engines do to tool calls, copied on demand so a test can show
what the gateway's repairs change. `SimConfig.misbehave` (the CLI's `--misbehave`, `/sim/config`'s
`misbehave`) names the modes, comma-separated; none is on by default, and with none every answer is
exactly what it was.

Leaked calls (the engine's tool parser is not set up for the model, or misses its variant: the call
stays in `content` and the answer ends with `stop`); each writes the call the simulator would have
made in one model family's form:

- `leak_xml`: Qwen3-Coder, `<tool_call><function=NAME><parameter=P>value</parameter>...`;
- `leak_hermes`: Hermes and Qwen 2.5/3, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- `leak_json`: a bare JSON object `{"name": ..., "arguments": {...}}` (Llama 3 style);
- `leak_glm`: GLM 4.5-4.7, `<tool_call>NAME<arg_key>P</arg_key><arg_value>value</arg_value>...`;
- `think_call`: the Qwen3-Coder form inside the reasoning (the model called before it closed its
  thinking, so the reasoning parser kept everything), with no content.

Broken ids in parallel calls (the call is made twice, as a model asked for two files would):

- `dup_ids`: both calls carry the same id (chat `id`, Messages `id`, Responses `call_id`);
- `missing_ids`: neither carries one.

Every dialect is rendered from the same generated answer (dialect.py, messages.py, responses.py):
leaks change that answer; the id modes change the rendered answer and stream of each dialect.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from gateway.simulator.output import Output
from gateway.types import Json

LEAKS = ("leak_xml", "leak_hermes", "leak_json", "leak_glm", "think_call")
IDS = ("dup_ids", "missing_ids")
MODES = frozenset((*LEAKS, *IDS))


def modes(spec: str) -> frozenset[str]:
    """The modes a `misbehave` value names (comma-separated); ValueError for an unknown one."""
    names = frozenset(part.strip() for part in spec.split(",") if part.strip())
    unknown = names - MODES
    if unknown:
        raise ValueError(f"unknown misbehave modes {sorted(unknown)}; known: {sorted(MODES)}")
    return names


# --- leaked calls -------------------------------------------------------------------------------


def _raw(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def call_text(mode: str, name: str, arguments: Json) -> str:
    """A call as the model family of `mode` writes it."""
    if mode in ("leak_xml", "think_call"):
        params = "".join(f"<parameter={k}>\n{_raw(v)}\n</parameter>\n" for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if mode == "leak_glm":
        pairs = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{_raw(v)}</arg_value>\n" for k, v in arguments.items()
        )
        return f"<tool_call>{name}\n{pairs}</tool_call>"
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>" if mode == "leak_hermes" else body


def output(spec: str, out: Output) -> Output:
    """The generated answer with its call leaked as text, where a leak mode is on."""
    on = modes(spec)
    mode = next((m for m in LEAKS if m in on), None)
    if mode is None or out.tool_call is None:
        return out
    function = out.tool_call["function"]
    arguments = json.loads(function["arguments"])
    # Words joined again with single spaces: every dialect gives the text back exactly.
    words = tuple(call_text(mode, function["name"], arguments).split(" "))
    if mode == "think_call":
        return dataclasses.replace(
            out,
            reasoning=(*out.reasoning, *words),
            content=(),
            tool_call=None,
            tool_tokens=0,
            finish_reason="stop",
        )
    return dataclasses.replace(
        out, content=words, tool_call=None, tool_tokens=0, finish_reason="stop", answered=True
    )


# --- parallel calls with broken ids -------------------------------------------------------------


def _id_mode(spec: str) -> str | None:
    on = modes(spec)
    return next((m for m in IDS if m in on), None)


def _second(call: Json, key: str, mode: str, suffix: str = "") -> Json:
    """The parallel twin of a call: the same id, or none."""
    twin = dict(call)
    if mode == "missing_ids":
        twin.pop(key, None)
    if suffix and "id" in twin and key != "id":
        twin["id"] = f"{twin['id']}{suffix}"
    return twin


def _without(call: Json, key: str, mode: str) -> Json:
    return {k: v for k, v in call.items() if k != key} if mode == "missing_ids" else call


def whole(spec: str, payload: Json) -> Json:
    """A whole answer with its call made twice, where an id mode is on."""
    mode = _id_mode(spec)
    if mode is None:
        return payload
    choices = payload.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            message = choice.get("message") or {}
            calls = message.get("tool_calls")
            if calls:
                message["tool_calls"] = [_without(calls[0], "id", mode), _second(calls[0], "id", mode)]
        return payload
    content = payload.get("content")
    if payload.get("type") == "message" and isinstance(content, list):
        payload["content"] = _twinned(content, "tool_use", "id", mode)
        return payload
    output_items = payload.get("output")
    if isinstance(output_items, list):
        payload["output"] = _twinned(output_items, "function_call", "call_id", mode)
    return payload


def _twinned(items: list[Json], kind: str, key: str, mode: str) -> list[Json]:
    out: list[Json] = []
    for item in items:
        if item.get("type") == kind:
            out += [_without(item, key, mode), _second(item, key, mode, "_b")]
        else:
            out.append(item)
    return out


def _parse(event: bytes) -> tuple[str | None, Json | None]:
    name = None
    data: Json | None = None
    for line in event.split(b"\n"):
        if line.startswith(b"event: "):
            name = line[7:].decode()
        elif line.startswith(b"data: ") and line[6:7] == b"{":
            data = orjson.loads(line[6:])
    return name, data


def _encode(name: str | None, data: Json) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name is not None else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def stream(spec: str, events: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
    """A stream with its call made twice, where an id mode is on; otherwise the events as they are."""
    mode = _id_mode(spec)
    if mode is None:
        yield from events
        return
    twin = _Twin(mode)
    for count, event in events:
        name, data = _parse(event)
        if data is None:
            yield count, event
            continue
        for n, (out_name, out_data) in enumerate(twin.events(name, data)):
            yield (count if n == 0 else 0), _encode(out_name, out_data)


class _Twin:
    """Rewrites one stream's events: each call's events again, for its twin, right after it."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.recorded: list[tuple[str | None, Json]] = []  # the call's events (Messages, Responses)
        self.at: int | None = None  # the call's block or output index
        self.sequence = 0

    def events(self, name: str | None, data: Json) -> list[tuple[str | None, Json]]:
        if "choices" in data:
            return [(name, d) for d in self._chat(data)]
        kind = data.get("type")
        if isinstance(kind, str) and kind.startswith("response."):
            out = self._responses(name, data)
            for _, item in out:
                item["sequence_number"] = self.sequence
                self.sequence += 1
            return out
        return self._messages(name, data)

    def _chat(self, data: Json) -> list[Json]:
        choices = data["choices"]
        delta: Json = choices[0].get("delta") or {} if choices else {}
        calls = delta.get("tool_calls")
        if not calls:
            return [data]
        first = {
            **data,
            "choices": [
                {**choices[0], "delta": {**delta, "tool_calls": [_without(calls[0], "id", self.mode)]}}
            ],
        }
        twin_call = {**_second(calls[0], "id", self.mode), "index": 1}
        second = {
            **data,
            "choices": [{**choices[0], "delta": {"tool_calls": [twin_call]}, "finish_reason": None}],
        }
        if choices[0].get("finish_reason") is not None:  # vLLM: the call and the end in one chunk
            first["choices"][0]["finish_reason"] = None
            second["choices"][0]["finish_reason"] = choices[0]["finish_reason"]
        return [first, second]

    def _messages(self, name: str | None, data: Json) -> list[tuple[str | None, Json]]:
        kind = data.get("type")
        block = data.get("content_block")
        if kind == "content_block_start" and isinstance(block, dict) and block.get("type") == "tool_use":
            self.at = data["index"]
            data = {**data, "content_block": _without(block, "id", self.mode)}
        if self.at is None or data.get("index") != self.at:
            return [(name, data)]
        self.recorded.append((name, data))
        if kind != "content_block_stop":
            return [(name, data)]
        at, self.at = self.at + 1, None
        copies = [(n, {**d, "index": at}) for n, d in self.recorded]
        self.recorded = []
        start = copies[0][1]
        start["content_block"] = _second(start["content_block"], "id", self.mode)
        return [(name, data), *copies]

    def _responses(self, name: str | None, data: Json) -> list[tuple[str | None, Json]]:
        kind = data.get("type")
        item = data.get("item")
        if kind == "response.completed" and isinstance(data.get("response"), dict):
            response = data["response"]
            response["output"] = _twinned(response.get("output") or [], "function_call", "call_id", self.mode)
            return [(name, data)]
        if isinstance(item, dict) and item.get("type") == "function_call":
            self.at = data["output_index"]
            data = {**data, "item": _without(item, "call_id", self.mode)}
        if self.at is None or data.get("output_index") != self.at:
            return [(name, data)]
        self.recorded.append((name, data))
        if kind != "response.output_item.done":
            return [(name, data)]
        at, self.at = self.at + 1, None
        copies = []
        for copy_name, copied in self.recorded:
            copied = {**copied, "output_index": at}
            if isinstance(copied.get("item"), dict):
                copied["item"] = _second(copied["item"], "call_id", self.mode, "_b")
            if "item_id" in copied:
                copied["item_id"] = f"{copied['item_id']}_b"
            copies.append((copy_name, copied))
        self.recorded = []
        return [(name, data), *copies]
