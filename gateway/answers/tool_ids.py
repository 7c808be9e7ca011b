"""Every tool call that leaves the gateway has an id of its own, and its arguments.

Engines' parsers get ids wrong in streams with parallel calls: missing (an empty or absent `id`),
repeated within the answer, or repeated from an earlier turn (a counter that restarts each turn).
Claude Code then sends tool results whose ids collide, which Anthropic's own check refuses with
"`tool_use` ids must be unique"; OpenAI clients merge two calls into one. So in the answer, whole and
streamed, a call whose id is missing, already used in this answer or already used in the request's
history gets a fresh one; any other id passes untouched.

No state is kept between turns: the client sends the ids it was given, and the engine never needs
its own back (neither engine checks a result's id against anything; the chat templates render the
ids, if at all, as given). A minted id is random, unique in its last 9 characters (vLLM keeps only
those for Mistral-style templates), and from then on the conversation's own.

A call streamed without any arguments (some parsers drop a zero-argument call's `{}`) gets `{}`, so
the client has JSON to parse.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, Final

import orjson

from gateway.answers.changes import Change
from gateway.answers.events import Event, make

_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
ID_CHARS = 24
MAX_USED = 100_000  # ids remembered from the history: the body's size bounds them already

Mint = Callable[[str], str]


def mint(prefix: str) -> str:
    """A fresh id: `prefix` and 24 random alphanumerics (the prefix each dialect's ids carry)."""
    return prefix + "".join(_ALPHABET[b % 62] for b in os.urandom(ID_CHARS))


class Ids:
    """The ids used so far (the history's, then the answer's) and the fresh ones given out."""

    def __init__(self, used: Iterable[str] = (), minter: Mint = mint) -> None:
        self.used: set[str]
        if isinstance(used, list) and len(used) <= MAX_USED:
            # A history's ids (history_ids keeps at most that many): one set at C speed, where the
            # loop below cost a call and a check per id of a long session.
            self.used = set(used)
        else:
            self.used = set()
            for value in used:
                if len(self.used) >= MAX_USED:
                    break
                self.used.add(value)
        self.minter = minter
        self.minted = 0

    def check(self, given: Any, prefix: str) -> str:
        """`given` when it is a fresh, non-empty string; otherwise a new id."""
        if isinstance(given, str) and given and given not in self.used:
            self.used.add(given)
            return given
        return self.fresh(prefix)

    def fresh(self, prefix: str) -> str:
        while True:
            value = self.minter(prefix)
            if value not in self.used:
                self.used.add(value)
                self.minted += 1
                return value


def history_ids(body: dict[str, Any], form: str) -> list[str]:
    """The tool-call ids a request's history already uses (calls and results), in order.

    Read on every request that declares tools, over the whole history: comprehensions, not a call
    per id (a 300-turn Claude Code history: 101 us, against 121 with a nested function per id)."""
    items = body.get("input" if form == "responses" else "messages")
    if not isinstance(items, list):
        return []
    values: list[Any]
    if form == "chat":
        values = []
        for item in items:
            if isinstance(item, dict):
                values.append(item.get("tool_call_id"))
                calls = item.get("tool_calls")
                if isinstance(calls, list):
                    values += [call.get("id") if isinstance(call, dict) else None for call in calls]
    elif form == "messages":
        values = [
            block.get("id") if block.get("type") == "tool_use" else block.get("tool_use_id")
            for item in items
            if isinstance(item, dict) and isinstance(content := item.get("content"), list)
            for block in content
            if isinstance(block, dict)
        ]
    else:
        values = [item.get("call_id") for item in items if isinstance(item, dict)]
    return [value for value in values if isinstance(value, str) and value][:MAX_USED]


def _json_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


# --- chat completions ---------------------------------------------------------------------------


class _Slot:
    __slots__ = ("args", "id", "out", "upstream_id")

    def __init__(self, out: int, upstream_id: Any, id_: str) -> None:
        self.out, self.upstream_id, self.id, self.args = out, upstream_id, id_, False


_ENDS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"')


class ChatIds(Change):
    """Chat completions: `tool_calls[].id` unique, and each streamed call on an index of its own."""

    name = "tool_ids"
    markers: tuple[bytes, ...] | None = (b'"tool_calls"',)  # chat events without a call pass as they came

    def __init__(self, ids: Ids) -> None:
        self.ids = ids
        self.slots: dict[int, dict[int, _Slot]] = {}  # choice -> upstream index -> its call
        self.last: dict[int, _Slot] = {}  # choice -> the call streamed last
        self.count: dict[int, int] = {}  # choice -> calls so far

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        choices = payload.get("choices")
        if not isinstance(choices, list):
            return payload
        out = []
        for choice in choices:
            message = choice.get("message") if isinstance(choice, dict) else None
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            if isinstance(calls, list) and calls:
                fixed = [self._whole_call(c) for c in calls]
                if any(a is not b for a, b in zip(fixed, calls, strict=True)):
                    choice = {**choice, "message": {**message, "tool_calls": fixed}}  # type: ignore[dict-item]
            out.append(choice)
        return {**payload, "choices": out}

    def _whole_call(self, call: Any) -> Any:
        if not isinstance(call, dict):
            return call
        checked = self.ids.check(call.get("id"), "call_")
        function = call.get("function")
        fixed = call if checked == call.get("id") else {**call, "id": checked}
        if isinstance(function, dict) and not _json_text(function.get("arguments")):
            fixed = {**fixed, "function": {**function, "arguments": "{}"}}
        return fixed

    def stream(self, event: Event) -> list[Event]:
        """Fixes one chat chunk's streamed calls: ids made unique, each call on an output index of
        its own, and `{}` arguments added at the finish for calls that got none; a chunk that needs
        no change is returned untouched."""
        data = event.data
        choices = data.get("choices") if data is not None else None
        if not isinstance(choices, list) or not choices:
            return [event]
        changed = False
        fixed_choices = []
        for choice in choices:
            if isinstance(choice, dict):
                fixed = self._choice(choice)
                changed = changed or fixed is not choice
                choice = fixed
            fixed_choices.append(choice)
        if changed:
            event.data = {**data, "choices": fixed_choices}  # type: ignore[dict-item]
            event.changed()
        return [event]

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        index = choice.get("index", 0) if isinstance(choice.get("index"), int) else 0
        delta = choice.get("delta")
        calls = delta.get("tool_calls") if isinstance(delta, dict) else None
        fixed = list(calls) if isinstance(calls, list) else []
        for position, call in enumerate(fixed):
            if isinstance(call, dict):
                fixed[position] = self._call(index, call)
        if choice.get("finish_reason") is not None:
            # Calls that never got arguments get `{}` with the answer's end.
            for slot in sorted(self.slots.get(index, {}).values(), key=lambda s: s.out):
                if not slot.args:
                    slot.args = True
                    fixed.append({"index": slot.out, "function": {"arguments": "{}"}})
        if (not isinstance(calls, list) and not fixed) or (
            isinstance(calls, list)
            and len(fixed) == len(calls)
            and all(a is b for a, b in zip(fixed, calls, strict=True))
        ):
            return choice
        return {**choice, "delta": {**(delta if isinstance(delta, dict) else {}), "tool_calls": fixed}}

    def _call(self, choice: int, call: dict[str, Any]) -> dict[str, Any]:
        slots = self.slots.setdefault(choice, {})
        position = call.get("index")
        given = call.get("id")
        function = call.get("function")
        named = isinstance(function, dict) and bool(function.get("name"))
        # Without an index, a delta without a name continues the call streamed last.
        slot = slots.get(position) if isinstance(position, int) else None if named else self.last.get(choice)
        # A new call: an index not seen before, or a seen one that now comes with a name and
        # another id (two parallel calls streamed on one index).
        new = slot is None or (
            named
            and isinstance(given, str)
            and bool(given)
            and bool(slot.upstream_id)
            and given != slot.upstream_id
        )
        if new:
            out = self.count.get(choice, 0)
            self.count[choice] = out + 1
            slot = _Slot(out, given, self.ids.check(given, "call_"))
            slots[position if isinstance(position, int) else -1 - out] = slot
            self.last[choice] = slot
        assert slot is not None
        if isinstance(function, dict) and _json_text(function.get("arguments")):
            slot.args = True
        fixed = call
        if position != slot.out:
            fixed = {**fixed, "index": slot.out}
        if (new or "id" in call) and given != slot.id:
            fixed = {**fixed, "id": slot.id}
        return fixed


# --- Anthropic Messages -------------------------------------------------------------------------


class MessagesIds(Change):
    """Messages: each `tool_use` block's `id` unique; its input streamed as `input_json_delta`."""

    name = "tool_ids"
    markers: tuple[bytes, ...] | None = (b'"tool_use"', b"input_json_delta")

    @property
    def engaged(self) -> bool:
        return bool(self.open)  # a tool_use block without its input yet: its stop must be seen

    def __init__(self, ids: Ids) -> None:
        self.ids = ids
        self.open: dict[int, Any] = {}  # tool_use blocks without an input delta yet: index -> input

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        content = payload.get("content")
        if not isinstance(content, list):
            return payload
        fixed = []
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                checked = self.ids.check(block.get("id"), "toolu_")
                if checked != block.get("id") or not isinstance(block.get("input"), dict):
                    block = {**block, "id": checked, "input": _input(block.get("input"))}
            fixed.append(block)
        return {**payload, "content": fixed}

    def stream(self, event: Event) -> list[Event]:
        """Makes each streamed `tool_use` block's id unique; a block that got no `input_json_delta`
        before its stop gets one holding its start's input (or `{}`), since Claude Code reads input
        only from deltas."""
        data = event.data
        if data is None:
            return [event]
        kind = data.get("type")
        index = data.get("index")
        if kind == "content_block_start" and isinstance(data.get("content_block"), dict):
            block = data["content_block"]
            if block.get("type") == "tool_use":
                self.open[index if isinstance(index, int) else 0] = block.get("input")
                checked = self.ids.check(block.get("id"), "toolu_")
                if checked != block.get("id"):
                    event.data = {**data, "content_block": {**block, "id": checked}}
                    event.changed()
        elif kind == "content_block_delta" and index in self.open:
            delta = data.get("delta")
            if isinstance(delta, dict) and delta.get("partial_json"):
                del self.open[index]
        elif kind == "content_block_stop" and index in self.open:
            # Claude Code reads a tool's input from its deltas only, never from the block's start.
            text = _dumps(_input(self.open.pop(index)))
            delta = {"type": "input_json_delta", "partial_json": text}
            return [make({"type": "content_block_delta", "index": index, "delta": delta}), event]
        return [event]


def _input(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


# --- Responses ----------------------------------------------------------------------------------

CALL_ITEMS = ("function_call", "custom_tool_call")
# Final, so that a compiled class (mypyc) takes it as a constant default.
_RESPONSES_MARKERS: Final = (b'"function_call"', b'"custom_tool_call"', b"function_call_arguments", *_ENDS)


class ResponsesIds(Change):
    """Responses: each call item's `call_id` unique (the same on its added and done events and in
    the final response); a function call's empty arguments become `{}`."""

    name = "tool_ids"
    markers: tuple[bytes, ...] | None = _RESPONSES_MARKERS

    def __init__(self, ids: Ids) -> None:
        self.ids = ids
        self.by_index: dict[int, str] = {}  # output_index -> the call id given out

    def _item(self, item: dict[str, Any], index: int | None, done: bool) -> dict[str, Any]:
        if item.get("type") not in CALL_ITEMS:
            return item
        given = item.get("call_id")
        if index is not None and index in self.by_index:
            call_id = self.by_index[index]
        else:
            call_id = self.ids.check(given, "call_")
            if index is not None:
                self.by_index[index] = call_id
        fixed = item if call_id == given else {**item, "call_id": call_id}
        if done and item.get("type") == "function_call" and not _json_text(item.get("arguments")):
            fixed = {**fixed, "arguments": "{}"}
        return fixed

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        output = payload.get("output")
        if not isinstance(output, list):
            return payload
        fixed = [self._item(i, n, True) if isinstance(i, dict) else i for n, i in enumerate(output)]
        if all(a is b for a, b in zip(fixed, output, strict=True)):
            return payload
        return {**payload, "output": fixed}

    def stream(self, event: Event) -> list[Event]:
        """Gives each streamed call item a unique `call_id`, the same on its added and done events,
        fills a function call's empty arguments with `{}`, and applies the same fixes to the final
        response."""
        data = event.data
        if data is None:
            return [event]
        kind = data.get("type")
        if kind in ("response.output_item.added", "response.output_item.done") and isinstance(
            data.get("item"), dict
        ):
            index = data.get("output_index")
            item = self._item(data["item"], index if isinstance(index, int) else None, kind.endswith("done"))
            if item is not data["item"]:
                event.data = {**data, "item": item}
                event.changed()
        elif kind == "response.function_call_arguments.done" and not _json_text(data.get("arguments")):
            event.data = {**data, "arguments": "{}"}
            event.changed()
        elif kind in ("response.completed", "response.incomplete", "response.failed") and isinstance(
            data.get("response"), dict
        ):
            response = self.whole(data["response"])
            if response is not data["response"]:
                event.data = {**data, "response": response}
                event.changed()
        return [event]
