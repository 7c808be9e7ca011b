"""A whole answer built from a stream, in the shape the client's dialect gives a non-streaming one.

The gateway asks some engines for a stream even when the client wants the whole answer: this
llama-server build keeps generating a non-streaming answer after its client left (until the budget
is spent) but stops a stream at once (docs/engines.md). The client then gets what a non-streaming
request returns (text, reasoning, tool calls, finish reason, usage), assembled here.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.answers.events import Event

Json = dict[str, Any]


class Assembler:
    """Feeds on a dialect's stream events; `result()` is the whole answer."""

    def feed(self, event: Event) -> None:
        raise NotImplementedError

    def result(self) -> Json:
        raise NotImplementedError


class ChatAssembler(Assembler):
    """`chat.completion.chunk` events into one `chat.completion` (or `text_completion`)."""

    def __init__(self, text: bool = False) -> None:
        self.text = text  # /v1/completions: choices carry `text`
        self.head: Json = {}
        self.choices: dict[int, Json] = {}
        self.calls: dict[int, dict[int, Json]] = {}
        self.extra: Json = {}  # usage, timings: whatever the last chunks carried

    def feed(self, event: Event) -> None:
        data = event.data
        if data is None:
            return
        if not self.head:
            self.head = {k: data[k] for k in ("id", "created", "model", "system_fingerprint") if k in data}
        for key in ("usage", "timings"):
            if data.get(key) is not None:
                self.extra[key] = data[key]
        for choice in data.get("choices") or ():
            if isinstance(choice, dict):
                self._choice(choice)

    def _choice(self, choice: Json) -> None:
        index = choice.get("index", 0) if isinstance(choice.get("index"), int) else 0
        into = self.choices.setdefault(index, {"index": index, "finish_reason": None})
        if choice.get("finish_reason") is not None:
            into["finish_reason"] = choice["finish_reason"]
        if self.text:
            if isinstance(choice.get("text"), str):
                into["text"] = into.get("text", "") + choice["text"]
            return
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        message = into.setdefault("message", {"role": "assistant", "content": None})
        if isinstance(delta.get("role"), str):
            message["role"] = delta["role"]
        for key in ("content", "reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str):
                message[key] = (message.get(key) or "") + delta[key]
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict):
                self._call(index, call)

    def _call(self, choice: int, call: Json) -> None:
        position = call.get("index", 0) if isinstance(call.get("index"), int) else 0
        calls = self.calls.setdefault(choice, {})
        into = calls.setdefault(
            position, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if isinstance(call.get("id"), str):
            into["id"] = call["id"]
        function = call.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    into["function"][key] += function[key]

    def result(self) -> Json:
        choices = []
        for index in sorted(self.choices):
            choice = self.choices[index]
            if index in self.calls:
                choice["message"]["tool_calls"] = [self.calls[index][p] for p in sorted(self.calls[index])]
            if self.text:
                choice.setdefault("text", "")
            choices.append(choice)
        kind = "text_completion" if self.text else "chat.completion"
        return {**self.head, "object": kind, "choices": choices, **self.extra}


class MessagesAssembler(Assembler):
    """Anthropic Messages events into one `message`."""

    def __init__(self) -> None:
        self.message: Json = {}
        self.blocks: dict[int, Json] = {}
        self.partial: dict[int, str] = {}  # a tool_use block's input, as JSON text so far

    def feed(self, event: Event) -> None:
        """Takes one Messages stream event: the start's envelope, each block's start, text, thinking
        and signature deltas appended, a tool block's JSON parsed at its stop, and the final stop
        reason and usage merged in; events without data are skipped."""
        data = event.data
        if data is None:
            return
        kind = data.get("type")
        if kind == "message_start" and isinstance(data.get("message"), dict):
            self.message = dict(data["message"])
        elif kind == "content_block_start" and isinstance(data.get("content_block"), dict):
            self.blocks[_index(data)] = dict(data["content_block"])
        elif kind == "content_block_delta" and isinstance(data.get("delta"), dict):
            self._delta(_index(data), data["delta"])
        elif kind == "content_block_stop":
            self._stop(_index(data))
        elif kind == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, dict):
                self.message.update({k: v for k, v in delta.items() if k in ("stop_reason", "stop_sequence")})
            if isinstance(data.get("usage"), dict):
                self.message["usage"] = {**(self.message.get("usage") or {}), **data["usage"]}

    def _delta(self, index: int, delta: Json) -> None:
        block = self.blocks.setdefault(index, {"type": "text", "text": ""})
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = block.get("text", "") + str(delta.get("text", ""))
        elif kind == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + str(delta.get("thinking", ""))
        elif kind == "signature_delta":
            block["signature"] = block.get("signature", "") + str(delta.get("signature", ""))
        elif kind == "input_json_delta":
            self.partial[index] = self.partial.get(index, "") + str(delta.get("partial_json", ""))

    def _stop(self, index: int) -> None:
        block = self.blocks.get(index)
        if block is None or block.get("type") not in ("tool_use", "server_tool_use"):
            return
        text = self.partial.pop(index, "")
        if text:
            try:
                block["input"] = orjson.loads(text)
            except orjson.JSONDecodeError:
                block["input"] = {}

    def result(self) -> Json:
        for index in list(self.partial):
            self._stop(index)
        message = {"type": "message", "role": "assistant", **self.message}
        message["content"] = [self.blocks[i] for i in sorted(self.blocks)]
        return message


class ResponsesAssembler(Assembler):
    """Responses events into one `response`: the final event carries it whole; items that finished
    before a stream broke off are kept otherwise."""

    def __init__(self) -> None:
        self.response: Json | None = None
        self.items: dict[int, Json] = {}

    def feed(self, event: Event) -> None:
        data = event.data
        if data is None:
            return
        response = data.get("response")
        if isinstance(response, dict):
            self.response = response
        if data.get("type") == "response.output_item.done" and isinstance(data.get("item"), dict):
            index = data.get("output_index")
            self.items[index if isinstance(index, int) else len(self.items)] = data["item"]

    def result(self) -> Json:
        response = dict(self.response or {"object": "response", "status": "incomplete"})
        if not response.get("output") and self.items:
            response["output"] = [self.items[i] for i in sorted(self.items)]
        return response


def _index(data: Json) -> int:
    index = data.get("index")
    return index if isinstance(index, int) else 0


def assembler_for(endpoint: str) -> Assembler | None:
    """The assembler for an endpoint's stream, or None when it has no stream form."""
    if endpoint == "chat":
        return ChatAssembler()
    if endpoint == "completions":
        return ChatAssembler(text=True)
    if endpoint == "messages":
        return MessagesAssembler()
    if endpoint == "responses":
        return ResponsesAssembler()
    return None
