"""Tool calls a model wrote as text, turned into the calls the client's dialect expects.

The `tool_call_repair` fix (opt-in per preset: a model whose engine parser is set up right never
needs it). When a request declared tools and the answer's text holds a complete call of one of them
(leaked.py reads the forms), the call goes out as a proper one: chat `tool_calls` with
`finish_reason: tool_calls`, a Messages `tool_use` block with `stop_reason: tool_use`, a Responses
`function_call` item (codex_calls.py, after this, turns those back into Codex's custom calls). The
text around the call stays text; anything that is not a complete call of a declared tool stays as
it came. Whole answers and streams alike: in a stream, text is held back only from a call's opening
marker on (bounded), so answers without calls stream as they come.

A call written inside the thinking (the model never closed it, so the engine's reasoning parser kept
everything) is taken too, but only when the answer itself has neither text nor calls: a model that
weighs a call in its thinking and then answers in words made no call. The thinking keeps its text.

Repaired calls are given ids of their own (tool_ids.py); they are sent when the text that held them
ends (the end of the answer, of a Messages text block, of a Responses message item), after the
engine's own calls, whose indexes are left as they are.

Memory is bounded whatever the replica sends: each text channel holds at most `MAX_HELD` characters
(leaked.py), at most `MAX_CHOICES` chat choices are repaired, and a Responses message's text sent so
far is kept for its `.done` events, which carry that text whole anyway (the relay bounds an event).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from gateway.answers.changes import Change, Changes
from gateway.answers.events import Event, make
from gateway.answers.leaked import MAX_HELD, Call, Scanner, Tools, split
from gateway.answers.tool_ids import ChatIds, Ids, MessagesIds, ResponsesIds, history_ids

REASONING_KEYS = ("reasoning_content", "reasoning")  # llama-server's and vLLM's chat field
# Choices of one chat answer repaired (`n` > 1): each holds up to MAX_HELD; the rest pass as they are.
MAX_CHOICES = 8


class _Text:
    """One text channel of an answer under repair: what to send of it, and the calls it held."""

    def __init__(self, tools: Tools, limit: int) -> None:
        self.scanner = Scanner(tools, limit)
        self.calls: list[Call] = []
        self.spoke = False  # text other than whitespace was sent

    def feed(self, text: str) -> str:
        return self._keep(self.scanner.feed(text))

    def end(self) -> str:
        return self._keep(self.scanner.end())

    def _keep(self, pieces: list[str | Call]) -> str:
        text = ""
        for piece in pieces:
            if isinstance(piece, Call):
                self.calls.append(piece)
            else:
                text += piece
        self.spoke = self.spoke or bool(text.strip())
        return text


def _thought_calls(thinking: _Text, answered: bool) -> list[Call]:
    """The calls written in the thinking, when the answer said nothing and called nothing."""
    thinking.end()
    return [] if answered else thinking.calls


# --- chat completions ---------------------------------------------------------------------------


class _Choice:
    def __init__(self, tools: Tools, limit: int) -> None:
        self.text = _Text(tools, limit)
        self.thinking = _Text(tools, limit)
        self.native = 0  # the engine's own calls: repaired ones are numbered after them
        self.done = False


class ChatRepair(Change):
    """Chat completions, whole (`message.content`) and streamed (`delta.content`)."""

    name = "tool_call_repair"

    def __init__(self, tools: Tools, ids: Ids, limit: int = MAX_HELD) -> None:
        self.tools, self.ids, self.limit = tools, ids, limit
        self.choices: dict[int, _Choice] = {}
        self.head: dict[str, Any] = {}  # the chunks' envelope, for the chunks written here
        self.repaired = 0

    # --- whole ---

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        choices = payload.get("choices")
        if not isinstance(choices, list):
            return payload
        fixed = [self._whole_choice(c) if isinstance(c, dict) else c for c in choices]
        if all(a is b for a, b in zip(fixed, choices, strict=True)):
            return payload
        return {**payload, "choices": fixed}

    def _whole_choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        message = choice.get("message")
        if not isinstance(message, dict):
            return choice
        native: list[Any] = message["tool_calls"] if isinstance(message.get("tool_calls"), list) else []
        content = message.get("content")
        text, calls = split(content, self.tools, self.limit) if isinstance(content, str) else ("", [])
        if not calls and not native and not text.strip():
            for key in REASONING_KEYS:
                if isinstance(message.get(key), str):
                    calls = split(message[key], self.tools, self.limit)[1]
                    text = content if isinstance(content, str) else ""
                    break
        if not calls:
            return choice
        self.repaired += len(calls)
        made = [self._function_call(call) for call in calls]
        message = {**message, "content": text if text.strip() else None, "tool_calls": [*native, *made]}
        return {**choice, "message": message, "finish_reason": _finish(choice.get("finish_reason"))}

    def _function_call(self, call: Call) -> dict[str, Any]:
        function = {"name": call.name, "arguments": call.arguments}
        return {"id": self.ids.fresh("call_"), "type": "function", "function": function}

    def _call(self, call: Call, index: int) -> dict[str, Any]:
        """A delta with one whole call at `index`."""
        return {"tool_calls": [{"index": index, **self._function_call(call)}]}

    # --- streamed ---

    def stream(self, event: Event) -> list[Event]:
        """Repairs one single-choice chat chunk: content is held back from a call's marker on and
        returned once known to be text; at the finish chunk the choice's leaked calls (or, failing
        any answer, its thinking's) go out as `tool_calls` chunks numbered after the engine's, with
        `finish_reason: tool_calls`."""
        data = event.data
        choices = data.get("choices") if data is not None else None
        if (
            data is None
            or not isinstance(choices, list)
            or len(choices) != 1
            or not isinstance(choices[0], dict)
        ):
            return [event]
        choice = choices[0]
        index = choice.get("index", 0) if isinstance(choice.get("index"), int) else 0
        if index not in self.choices and len(self.choices) >= MAX_CHOICES:
            return [event]
        state = self.choices.setdefault(index, _Choice(self.tools, self.limit))
        if state.done:
            return [event]
        self.head = {
            k: data[k] for k in ("id", "object", "created", "model", "system_fingerprint") if k in data
        }
        delta: dict[str, Any] = choice["delta"] if isinstance(choice.get("delta"), dict) else {}
        for key in REASONING_KEYS:
            if isinstance(delta.get(key), str):
                state.thinking.feed(delta[key])
        native = delta.get("tool_calls")
        if isinstance(native, list):
            positions: list[int] = [
                c["index"] for c in native if isinstance(c, dict) and isinstance(c.get("index"), int)
            ]
            state.native = max([state.native, *(p + 1 for p in positions)]) if positions else state.native + 1
        content = delta.get("content")
        text = state.text.feed(content) if isinstance(content, str) and content else content
        finish = choice.get("finish_reason")
        if finish is None:
            if text == content:
                return [event]
            if not text and set(delta) <= {"content"} and not data.get("usage"):
                return []  # all of it held back
            event.data = {**data, "choices": [{**choice, "delta": {**delta, "content": text}}]}
            return [event.changed()]
        state.done = True
        text = (text or "") + state.text.end()
        calls = state.text.calls or _thought_calls(state.thinking, bool(state.native) or state.text.spoke)
        if not calls:
            if text == (content or ""):
                return [event]
            event.data = {**data, "choices": [{**choice, "delta": {**delta, "content": text}}]}
            return [event.changed()]
        out: list[Event] = []
        rest = {k: v for k, v in delta.items() if k != "content"}
        if text or rest:
            said = {**rest, "content": text} if text else rest
            out.append(
                make({**self.head, "choices": [{"index": index, "delta": said, "finish_reason": None}]})
            )
        for position, call in enumerate(calls, start=state.native):
            said = self._call(call, position)
            out.append(
                make({**self.head, "choices": [{"index": index, "delta": said, "finish_reason": None}]})
            )
        self.repaired += len(calls)
        last = {**choice, "delta": {}, "finish_reason": _finish(finish)}
        event.data = {**data, "choices": [last]}
        return [*out, event.changed()]

    def end(self) -> list[Event]:
        """A stream that ended without its finish chunk: what is held goes out as it is."""
        out: list[Event] = []
        for index, state in self.choices.items():
            if state.done:
                continue
            state.done = True
            text = state.text.end()
            pieces: list[dict[str, Any]] = [{"content": text}] if text else []
            pieces += [self._call(c, n) for n, c in enumerate(state.text.calls, start=state.native)]
            self.repaired += len(state.text.calls)
            out += [
                make({**self.head, "choices": [{"index": index, "delta": p, "finish_reason": None}]})
                for p in pieces
            ]
        return out


def _finish(reason: Any) -> Any:
    return "tool_calls" if reason == "stop" else reason


# --- Anthropic Messages -------------------------------------------------------------------------


class _Renumbering(Change):
    """The client's block (Messages) or output (Responses) indexes for the engine's: a block the
    repair opens, or text it holds back, shifts the ones after it. `FIELD` names the index. A
    change itself rather than a mixin beside one: a compiled class (mypyc) has a single base."""

    FIELD: ClassVar[str]
    next: int  # the client's next index
    index: dict[int, int]  # the engine's index -> the client's

    def _take(self) -> int:
        taken = self.next
        self.next += 1
        return taken

    def _renumbered(self, event: Event, index: int) -> Event:
        """The engine's event with the client's index."""
        assert event.data is not None
        mapped = self.index.get(index, index)
        if mapped != index:
            event.data = {**event.data, self.FIELD: mapped}
            event.changed()
        return event


class _TextBlock:
    def __init__(self, event: Event, start: dict[str, Any], tools: Tools, limit: int) -> None:
        self.event = event  # the engine's start, sent as it came when nothing about it changes
        self.start = {**start, "content_block": {**start["content_block"], "text": ""}}
        self.given = bool(start["content_block"].get("text"))  # its text goes out as a delta
        self.text = _Text(tools, limit)
        self.out: int | None = None  # its index for the client, once its start went out


class MessagesRepair(_Renumbering):
    """Anthropic Messages: a text block's calls become `tool_use` blocks after it (a block left
    empty is not sent at all); the blocks after are numbered on."""

    FIELD = "index"

    name = "tool_call_repair"

    def __init__(self, tools: Tools, ids: Ids, limit: int = MAX_HELD) -> None:
        self.tools, self.ids, self.limit = tools, ids, limit
        self.next, self.index = 0, {}
        self.blocks: dict[int, _TextBlock] = {}
        self.thinking = _Text(tools, limit)
        self.native = 0
        self.spoke = False
        self.repaired = 0

    # --- whole ---

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Repairs a whole Messages answer: each text block's leaked calls become `tool_use` blocks
        after it (the block dropped if nothing else is left), thinking's calls only when the answer
        neither spoke nor called, and `stop_reason` becomes `tool_use`; the payload returns
        unchanged without calls."""
        content = payload.get("content")
        if not isinstance(content, list):
            return payload
        fixed: list[Any] = []
        calls = 0
        native = spoke = False
        thinking = _Text(self.tools, self.limit)
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text, found = split(block["text"], self.tools, self.limit)
                spoke = spoke or bool(text.strip())
                if not found:
                    fixed.append(block)
                    continue
                if text.strip():
                    fixed.append({**block, "text": text})
                fixed += [self._tool_use(call) for call in found]
                calls += len(found)
                continue
            if kind == "thinking" and isinstance(block.get("thinking"), str):
                thinking.feed(block["thinking"])
            native = native or kind == "tool_use"
            fixed.append(block)
        if not calls:
            found = _thought_calls(thinking, native or spoke)
            fixed += [self._tool_use(call) for call in found]
            calls = len(found)
        if not calls:
            return payload
        self.repaired += calls
        return {**payload, "content": fixed, "stop_reason": _stop(payload.get("stop_reason"))}

    def _tool_use(self, call: Call) -> dict[str, Any]:
        return {"type": "tool_use", "id": self.ids.fresh("toolu_"), "name": call.name, "input": call.value()}

    # --- streamed ---

    def stream(self, event: Event) -> list[Event]:
        """Repairs one Messages stream event: a text block's start is deferred until some text of it
        goes out, its leaked calls follow its stop as `tool_use` blocks, every later block is
        renumbered, and the final `message_delta` flushes open blocks and turns `end_turn` into
        `tool_use`."""
        data = event.data
        if data is None:
            return [event]
        kind = data.get("type")
        index = data.get("index") if isinstance(data.get("index"), int) else None
        if (
            kind == "content_block_start"
            and index is not None
            and isinstance(data.get("content_block"), dict)
        ):
            block = data["content_block"]
            if block.get("type") == "text":
                self.blocks[index] = _TextBlock(event, data, self.tools, self.limit)
                given = block.get("text")
                return self._said(index, given) if isinstance(given, str) and given else []
            self.native += block.get("type") == "tool_use"
            self.index[index] = self._take()
            return [self._renumbered(event, index)]
        if kind == "content_block_delta" and index is not None:
            delta: dict[str, Any] = data["delta"] if isinstance(data.get("delta"), dict) else {}
            if (
                index in self.blocks
                and delta.get("type") == "text_delta"
                and isinstance(delta.get("text"), str)
            ):
                return self._said(index, delta["text"], event)
            if delta.get("type") == "thinking_delta" and isinstance(delta.get("thinking"), str):
                self.thinking.feed(delta["thinking"])
            return [*self._opened(index), self._renumbered(event, index)]
        if kind == "content_block_stop" and index is not None:
            if index not in self.blocks:
                return [self._renumbered(event, index)]
            block = self.blocks.pop(index)
            out = self._said_text(index, block, block.text.end(), None)
            if block.out is not None:
                out.append(self._renumbered(event, index))
            self.spoke = self.spoke or block.text.spoke
            return out + self._blocks(block.text.calls)
        if kind == "message_delta":
            return self._message_delta(event, data)
        return [event]

    def _message_delta(self, event: Event, data: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        for open_index in list(self.blocks):  # a stream whose text block never stopped
            out += self.stream(make({"type": "content_block_stop", "index": open_index}))
        if not self.repaired:
            out += self._blocks(_thought_calls(self.thinking, bool(self.native) or self.spoke))
        delta = data.get("delta")
        if self.repaired and isinstance(delta, dict) and delta.get("stop_reason") == "end_turn":
            event.data = {**data, "delta": {**delta, "stop_reason": "tool_use"}}
            event.changed()
        return [*out, event]

    def end(self) -> list[Event]:
        out: list[Event] = []
        for open_index in list(self.blocks):
            out += self.stream(make({"type": "content_block_stop", "index": open_index}))
        return out

    def _opened(self, index: int) -> list[Event]:
        """A text block's deferred start, when something of it goes out."""
        block = self.blocks.get(index)
        if block is None or block.out is not None:
            return []
        block.out = self.index[index] = self._take()
        if block.out == index and not block.given:
            return [block.event]
        return [make({**block.start, "index": block.out})]

    def _said(self, index: int, text: str, event: Event | None = None) -> list[Event]:
        block = self.blocks[index]
        return self._said_text(index, block, block.text.feed(text), event)

    def _said_text(self, index: int, block: _TextBlock, text: str, event: Event | None) -> list[Event]:
        if not text:
            return []
        out = self._opened(index)
        if event is not None and event.data is not None and event.data["delta"].get("text") == text:
            return [*out, self._renumbered(event, index)]
        delta = {"type": "text_delta", "text": text}
        return [*out, make({"type": "content_block_delta", "index": block.out, "delta": delta})]

    def _blocks(self, calls: list[Call]) -> list[Event]:
        out: list[Event] = []
        for call in calls:
            at = self._take()
            block = {**self._tool_use(call), "input": {}}
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            out += [
                make({"type": "content_block_start", "index": at, "content_block": block}),
                make({"type": "content_block_delta", "index": at, "delta": delta}),
                make({"type": "content_block_stop", "index": at}),
            ]
        self.repaired += len(calls)
        return out


def _stop(reason: Any) -> Any:
    return "tool_use" if reason == "end_turn" else reason


# --- Responses ----------------------------------------------------------------------------------

_FINAL = ("response.completed", "response.incomplete", "response.failed")
_REASONING_DELTAS = ("response.reasoning_text.delta", "response.reasoning_summary_text.delta")


class _Message:
    def __init__(self, added: Event) -> None:
        self.held: list[Event] = [added]  # its events until something of it goes out
        self.parts: dict[int, _Text] = {}
        self.said: dict[int, str] = {}  # content_index -> the text sent
        self.out: int | None = None
        self.calls: list[Call] = []


class ResponsesRepair(_Renumbering):
    """Responses: a message item's calls become `function_call` items after it (an item left empty
    is not sent); `output_index` and `sequence_number` are numbered on, and the final response's
    `output` is what the client was sent."""

    FIELD = "output_index"

    name = "tool_call_repair"

    def __init__(self, tools: Tools, ids: Ids, limit: int = MAX_HELD) -> None:
        self.tools, self.ids, self.limit = tools, ids, limit
        self.next, self.index = 0, {}
        self.messages: dict[int, _Message] = {}
        self.thinking = _Text(tools, limit)
        self.items: list[Any] = []  # the items sent, done, in order
        self.native = 0
        self.spoke = False
        self.repaired = 0
        self.sequence: int | None = None

    # --- whole ---

    def whole(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Repairs a whole Responses answer: a message item's leaked calls become `function_call`
        items after it (the item dropped if it said nothing else), reasoning's calls only when the
        answer neither spoke nor called; the payload returns unchanged without calls."""
        output = payload.get("output")
        if not isinstance(output, list):
            return payload
        fixed: list[Any] = []
        calls = 0
        native = spoke = False
        thinking = _Text(self.tools, self.limit)
        for item in output:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "message":
                kept, found, said = self._whole_message(item)
                spoke = spoke or said
                fixed += ([kept] if kept is not None else []) + [self._item(c)[1] for c in found]
                calls += len(found)
                continue
            if kind == "reasoning":
                for text in _reasoning_texts(item):
                    thinking.feed(text + "\n")
            native = native or kind in ("function_call", "custom_tool_call")
            fixed.append(item)
        if not calls:
            found = _thought_calls(thinking, native or spoke)
            fixed += [self._item(c)[1] for c in found]
            calls = len(found)
        if not calls:
            return payload
        self.repaired += calls
        return {**payload, "output": fixed}

    def _whole_message(self, item: dict[str, Any]) -> tuple[dict[str, Any] | None, list[Call], bool]:
        content = item.get("content")
        if not isinstance(content, list):
            return item, [], False
        parts: list[Any] = []
        found: list[Call] = []
        for part in content:
            if (
                isinstance(part, dict)
                and part.get("type") == "output_text"
                and isinstance(part.get("text"), str)
            ):
                text, calls = split(part["text"], self.tools, self.limit)
                found += calls
                if text:
                    parts.append(part if not calls else {**part, "text": text})
                continue
            parts.append(part)
        said = any(isinstance(p, dict) and str(p.get("text", "")).strip() for p in parts)
        if not found:
            return item, [], said
        return ({**item, "content": parts} if said else None), found, said

    def _item(self, call: Call) -> tuple[dict[str, Any], dict[str, Any]]:
        """A repaired call's item as it opens and as it is done."""
        done = {
            "type": "function_call",
            "id": self.ids.fresh("fc_"),
            "call_id": self.ids.fresh("call_"),
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        return {**done, "arguments": "", "status": "in_progress"}, done

    # --- streamed ---

    def stream(self, event: Event) -> list[Event]:
        return self._numbered(self._events(event))

    def _events(self, event: Event) -> list[Event]:
        data = event.data
        if data is None:
            return [event]
        kind = data.get("type")
        index = data.get("output_index") if isinstance(data.get("output_index"), int) else None
        if kind == "response.output_item.added" and index is not None and isinstance(data.get("item"), dict):
            item = data["item"]
            if item.get("type") == "message":
                self.messages[index] = _Message(event)
                return []
            self.native += item.get("type") in ("function_call", "custom_tool_call")
            self.index[index] = self._take()
            return [self._renumbered(event, index)]
        if index is not None and index in self.messages:
            return self._message_event(event, data, index)
        if kind in _REASONING_DELTAS and isinstance(data.get("delta"), str):
            self.thinking.feed(data["delta"])
        elif kind == "response.reasoning_text.done":
            self.thinking.feed("\n")
        elif kind == "response.output_item.done" and isinstance(data.get("item"), dict):
            self.items.append(data["item"])
        elif kind in _FINAL and isinstance(data.get("response"), dict):
            out: list[Event] = []
            if not self.repaired:
                out = self._calls(_thought_calls(self.thinking, bool(self.native) or self.spoke))
            if self.repaired:
                event.data = {**data, "response": {**data["response"], "output": self.items}}
                event.changed()
            return [*out, event]
        return [self._renumbered(event, index)] if index is not None else [event]

    def _message_event(self, event: Event, data: dict[str, Any], index: int) -> list[Event]:
        message = self.messages[index]
        kind = data.get("type")
        part = data.get("content_index", 0) if isinstance(data.get("content_index"), int) else 0
        if kind == "response.output_text.delta" and isinstance(data.get("delta"), str):
            text = self._part(message, part).feed(data["delta"])
            return self._said(message, index, part, text, event)
        if kind == "response.output_text.done":
            text = self._part(message, part).end()
            out = self._said(message, index, part, text, None)
            if message.out is None:
                return out
            said = message.said.get(part, "")
            if data.get("text") != said:
                event.data = {**data, "text": said}
                event.changed()
            return [*out, self._renumbered(event, index)]
        if kind == "response.content_part.done" and isinstance(data.get("part"), dict):
            if message.out is None:
                return []
            if part in message.said and data["part"].get("text") != message.said[part]:
                event.data = {**data, "part": {**data["part"], "text": message.said[part]}}
                event.changed()
            return [self._renumbered(event, index)]
        if kind == "response.output_item.done" and isinstance(data.get("item"), dict):
            del self.messages[index]
            for part_text in message.parts.values():
                message.calls += part_text.calls
                self.spoke = self.spoke or part_text.spoke
            sent: list[Event] = []
            if message.out is not None:
                item = self._message_item(data["item"], message)
                if item is not data["item"]:
                    event.data = {**data, "item": item}
                    event.changed()
                self.items.append(item)
                sent.append(self._renumbered(event, index))
            return sent + self._calls(message.calls)
        if message.out is None:
            message.held.append(event)
            return []
        return [self._renumbered(event, index)]

    def _part(self, message: _Message, part: int) -> _Text:
        return message.parts.setdefault(part, _Text(self.tools, self.limit))

    def _said(self, message: _Message, index: int, part: int, text: str, event: Event | None) -> list[Event]:
        if not text:
            return []
        out: list[Event] = []
        if message.out is None:
            message.out = self.index[index] = self._take()
            out = [self._renumbered(held, index) for held in message.held]
            message.held.clear()
        message.said[part] = message.said.get(part, "") + text
        if event is not None and event.data is not None and event.data.get("delta") == text:
            return [*out, self._renumbered(event, index)]
        item_id = (event.data or {}).get("item_id") if event is not None else None
        delta = {
            "type": "response.output_text.delta",
            "item_id": item_id if item_id is not None else self._item_id(message),
            "output_index": message.out,
            "content_index": part,
            "delta": text,
        }
        return [*out, make(delta)]

    def _item_id(self, message: _Message) -> Any:
        added = message.held[0].data if message.held else None
        item = added.get("item") if isinstance(added, dict) else None
        return item.get("id") if isinstance(item, dict) else None

    def _message_item(self, item: dict[str, Any], message: _Message) -> dict[str, Any]:
        content = item.get("content")
        if not isinstance(content, list) or not message.calls:
            return item
        parts = []
        for position, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "output_text":
                said = message.said.get(position, "")
                if not said:
                    continue
                part = {**part, "text": said}
            parts.append(part)
        return {**item, "content": parts}

    def _calls(self, calls: list[Call]) -> list[Event]:
        out: list[Event] = []
        for call in calls:
            at = self._take()
            opened, done = self._item(call)
            where = {"item_id": done["id"], "output_index": at}
            out += [
                make({"type": "response.output_item.added", "output_index": at, "item": opened}),
                make({"type": "response.function_call_arguments.delta", **where, "delta": call.arguments}),
                make({"type": "response.function_call_arguments.done", **where, "arguments": call.arguments}),
                make({"type": "response.output_item.done", "output_index": at, "item": done}),
            ]
            self.items.append(done)
        self.repaired += len(calls)
        return out

    def end(self) -> list[Event]:
        out: list[Event] = []
        for index, message in list(self.messages.items()):
            done = {"type": "response.output_item.done", "output_index": index, "item": _item_of(message)}
            out += self._message_event(make(done), done, index)
        return self._numbered(out)

    def _numbered(self, events: list[Event]) -> list[Event]:
        """`sequence_number` runs on through the events added or left out."""
        for event in events:
            data = event.data
            if data is None or ("sequence_number" not in data and not self._made(event)):
                continue
            number = data.get("sequence_number")
            if self.sequence is None:
                self.sequence = number if isinstance(number, int) else 0
            if number != self.sequence:
                event.data = {**data, "sequence_number": self.sequence}
                event.changed()
            self.sequence += 1
        return events

    @staticmethod
    def _made(event: Event) -> bool:
        return (
            event.raw is None
            and event.data is not None
            and str(event.data.get("type", "")).startswith("response.")
        )


def _item_of(message: _Message) -> dict[str, Any]:
    added = message.held[0].data if message.held else None
    item = added.get("item") if isinstance(added, dict) else None
    return dict(item) if isinstance(item, dict) else {"type": "message", "content": []}


def _reasoning_texts(item: dict[str, Any]) -> list[str]:
    texts = []
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            texts += [
                str(p.get("text")) for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
            ]
    return texts


# --- the fix --------------------------------------------------------------------------------------

FORMS = ("chat", "messages", "responses")
_REPAIRS: dict[str, Callable[[Tools, Ids], Change]] = {
    "chat": ChatRepair,
    "messages": MessagesRepair,
    "responses": ResponsesRepair,
}
_IDS: dict[str, Callable[[Ids], Change]] = {
    "chat": ChatIds,
    "messages": MessagesIds,
    "responses": ResponsesIds,
}


def declared_tools(body: dict[str, Any], form: str) -> Tools:
    """The function tools a request declares, by name, with their argument schemas."""
    tools = body.get("tools")
    schemas: dict[str, Any] = {}
    if not isinstance(tools, list):
        return Tools(schemas)
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if form == "chat":
            function = tool.get("function")
            if tool.get("type", "function") == "function" and isinstance(function, dict):
                name, schema = function.get("name"), function.get("parameters")
            else:
                continue
        elif form == "messages":
            if tool.get("type") not in (None, "custom"):
                continue  # Anthropic's server tools: the engine never sees them
            name, schema = tool.get("name"), tool.get("input_schema")
        else:
            if tool.get("type") != "function":
                continue
            name, schema = tool.get("name"), tool.get("parameters")
        if isinstance(name, str) and name:
            schemas[name] = schema
    return Tools(schemas)


def tool_calls(body: dict[str, Any], changes: Changes, form: str, *, repair: bool) -> None:
    """The answer's tool-call changes for a request that declared tools: unique ids always, and
    with `repair` (the preset's `tool_call_repair`) leaked calls repaired. They go first in
    `changes`: they read the engine's own answer, and what renames calls for the client
    (codex_calls.py) must see the repaired ones. Call it after the fixes that change the tools the
    engine sees (codex_tools), so the tools read here are the engine's."""
    if form not in FORMS:
        return
    tools = declared_tools(body, form)
    if not tools:
        return
    used = history_ids(body, form)
    first: list[Change] = [_REPAIRS[form](tools, Ids(used))] if repair else []
    first.append(_IDS[form](Ids(used)))
    changes.items[0:0] = first
