"""The OpenAI Responses dialect (``/v1/responses``) and its store of finished responses.

A Responses request becomes a chat request first (instructions, tools, then the input items, in order),
so it renders, caches, thinks and calls tools exactly as chat does. Usage's ``input_tokens`` counts the
cached tokens too. Unless ``store`` is false, the last 64 responses are kept for
``GET``/``DELETE /v1/responses/{id}``, ``POST .../cancel`` and ``previous_response_id``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.simulator import dialect, engine
from gateway.simulator.dialect import Reply
from gateway.simulator.engine import ApiError, Prepared, SimConfig
from gateway.types import Json

KEEP = 64
ECHOED = ("instructions", "max_output_tokens", "previous_response_id", "reasoning", "tool_choice")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _parts(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    parts: list[Json] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", part.get("refusal", "")))})
        elif part.get("type") == "input_image":
            url = part.get("image_url") or part.get("file_id") or ""
            parts.append({"type": "image_url", "image_url": {"url": str(url)}})
    return parts


def _items(cfg: SimConfig, items: list[Any]) -> list[Json]:
    """Input items as chat messages: consecutive function calls join one assistant message."""
    out: list[Json] = []
    for item in items:
        if not isinstance(item, dict):
            raise engine.bad_request(cfg, "Cannot determine type of 'item'", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            out.append(
                {"role": "system" if role == "developer" else role, "content": _parts(item.get("content"))}
            )
        elif kind == "function_call":
            call = {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}
            entry = {"id": item.get("call_id", ""), "type": "function", "function": call}
            if out and out[-1].get("role") == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(entry)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [entry]})
        elif kind == "function_call_output":
            content = _parts(item.get("output", ""))
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": content})
        elif kind != "reasoning" and cfg.engine == "llamacpp":
            raise engine.bad_request(cfg, "Cannot determine type of 'item'", "input")
    return out


def _function(tool: Json) -> Json:
    fn: Json = {"name": tool.get("name")}
    for key in ("description", "parameters", "strict"):
        if key in tool:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


class Store:
    """A replica's finished responses (the newest ``KEEP``) and the Responses endpoint bound to them."""

    def __init__(self, config: SimConfig) -> None:
        self.vllm = config.engine == "vllm"
        self.items: OrderedDict[str, tuple[Json, list[Json]]] = OrderedDict()
        self.wire = dialect.Wire(self.prepare, self.response, self.stream, "resp_")

    def reset(self) -> None:
        self.items.clear()

    def _not_found(self, rid: str) -> ApiError:
        message = f"Response with id '{rid}' not found."
        if self.vllm:
            return engine.vllm_error(404, message, "invalid_request_error")
        return engine.llama_error(404, message, "not_found_error")

    def _keep(self, r: Reply, body: Json) -> None:
        if r.prep.meta["store"]:
            said: Json = {"role": "assistant", "content": " ".join(r.out.content)}
            if r.out.tool_call is not None:
                said["tool_calls"] = [r.out.tool_call]
            self.items[r.rid] = (body, [*r.prep.meta["turns"], said])
            while len(self.items) > KEEP:
                self.items.popitem(last=False)

    # --- request -> chat ---------------------------------------------------------------------------

    def to_chat(self, cfg: SimConfig, body: Json) -> tuple[Json, list[Json]]:
        """(the chat request, the conversation to remember: every turn but the instructions)."""
        turns: list[Json] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if previous not in self.items:
                raise self._not_found(str(previous))
            turns.extend(self.items[previous][1])
        given = body.get("input")
        if isinstance(given, str):
            turns.append({"role": "user", "content": given})
        elif isinstance(given, list):
            turns.extend(_items(cfg, given))
        else:
            raise engine.bad_request(cfg, "'input' is required: a string or a list of items", "input")
        instructions = body.get("instructions")
        head = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        chat: Json = {
            "model": body.get("model"),
            "messages": head + turns,
            "stream": body.get("stream") is True,
        }
        tools = body.get("tools")
        if isinstance(tools, list):
            chat["tools"] = [
                _function(t) for t in tools if isinstance(t, dict) and t.get("type") == "function"
            ]
        if "tool_choice" in body:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        reasoning = body.get("reasoning")
        if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
        if "chat_template_kwargs" in body:
            chat["chat_template_kwargs"] = body["chat_template_kwargs"]
        return chat, turns

    def prepare(self, cfg: SimConfig, raw: bytes, content_type: str | None) -> Prepared:
        body = engine.parse(cfg, raw, content_type)
        chat, turns = self.to_chat(cfg, body)
        meta = {"request": {k: body.get(k) for k in ECHOED}, "store": body.get("store") is not False}
        meta.update(turns=turns, tools=body.get("tools") or [], metadata=body.get("metadata") or {})
        return engine.prepare_body(cfg, "chat", chat, meta, guess_tools=False)

    # --- reply -> Responses ------------------------------------------------------------------------

    def response(self, cfg: SimConfig, r: Reply) -> Json:
        body = _final(cfg, r)
        self._keep(r, body)
        return body

    def stream(self, cfg: SimConfig, r: Reply) -> Iterator[tuple[int, bytes]]:
        """response.created and .in_progress, each output item's added/deltas/done, response.completed."""
        seq = itertools.count()

        def event(kind: str, data: Json) -> bytes:
            payload = {"type": kind, "sequence_number": next(seq), **data}
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

        start = _body(cfg, r, "in_progress", [])
        start["usage"] = None
        yield 0, event("response.created", {"response": start})
        yield 0, event("response.in_progress", {"response": start})
        final = _final(cfg, r)
        for index, item in enumerate(final["output"]):
            at = {"item_id": item["id"], "output_index": index}
            yield 0, event("response.output_item.added", {"output_index": index, "item": _opening(item)})
            if item["type"] == "reasoning":
                yield from _texts(event, at, r.out.reasoning, cfg.chunk_tokens, "response.reasoning_text")
            elif item["type"] == "function_call":
                args = item["arguments"]
                yield (
                    r.out.tool_tokens,
                    event("response.function_call_arguments.delta", {**at, "delta": args}),
                )
                done = {**at, "name": item["name"], "arguments": args}
                yield 0, event("response.function_call_arguments.done", done)
            else:
                part = item["content"][0]
                opened = {**at, "content_index": 0, "part": {**part, "text": ""}}
                yield 0, event("response.content_part.added", opened)
                yield from _texts(event, at, r.out.content, cfg.chunk_tokens, "response.output_text")
                yield 0, event("response.content_part.done", {**at, "content_index": 0, "part": part})
            yield 0, event("response.output_item.done", {"output_index": index, "item": item})
        self._keep(r, final)
        yield 0, event("response.completed", {"response": final})

    # --- the stored responses ----------------------------------------------------------------------

    def _error(self, exc: ApiError) -> Response:
        return Response(orjson.dumps(exc.payload), exc.status, media_type="application/json")

    def _found(self, request: Request) -> tuple[str, Json | None]:
        rid = str(request.path_params["response_id"])
        entry = self.items.get(rid)
        return rid, None if entry is None else entry[0]

    async def get(self, request: Request) -> Response:
        rid, body = self._found(request)
        if body is None:
            return self._error(self._not_found(rid))
        return Response(orjson.dumps(body), media_type="application/json")

    async def delete(self, request: Request) -> Response:
        rid, body = self._found(request)
        if body is None:
            return self._error(self._not_found(rid))
        del self.items[rid]
        deleted = {"id": rid, "object": "response.deleted", "deleted": True}
        return Response(orjson.dumps(deleted), media_type="application/json")

    async def cancel(self, request: Request) -> Response:
        # Only a background response can be cancelled; the simulator runs none, as vLLM without them.
        rid, body = self._found(request)
        if body is None:
            return self._error(self._not_found(rid))
        message = "Cannot cancel a synchronous response."
        if self.vllm:
            return self._error(engine.vllm_error(400, message, "invalid_request_error"))
        return self._error(engine.llama_error(400, message, "invalid_request_error"))


def _final(cfg: SimConfig, r: Reply) -> Json:
    body = _body(cfg, r, "completed", _output(r))
    if r.out.finish_reason == "length":
        body.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    return body


def _output(r: Reply) -> list[Json]:
    out, suffix = r.out, r.rid.removeprefix("resp_")
    items: list[Json] = []
    if out.reasoning:
        text = " ".join(out.reasoning)
        content = [{"type": "reasoning_text", "text": text}]
        items.append({"type": "reasoning", "id": f"rs_{suffix}", "summary": [], "content": content})
    if out.tool_call is not None:
        fn = out.tool_call["function"]
        call = {"type": "function_call", "id": f"fc_{suffix}", "call_id": out.tool_call["id"]}
        items.append({**call, "name": fn["name"], "arguments": fn["arguments"], "status": "completed"})
    elif out.content:
        part = {"type": "output_text", "text": " ".join(out.content), "annotations": []}
        message = {"type": "message", "id": f"msg_{suffix}", "status": "completed", "role": "assistant"}
        items.append({**message, "content": [part]})
    return items


def _opening(item: Json) -> Json:
    if item["type"] == "reasoning":
        return {**item, "content": []}
    if item["type"] == "function_call":
        return {**item, "arguments": "", "status": "in_progress"}
    return {**item, "content": [], "status": "in_progress"}


def _texts(event: Any, at: Json, words: tuple[str, ...], step: int, kind: str) -> Iterator[tuple[int, bytes]]:
    for count, text in dialect.chunks(words, step):
        yield count, event(f"{kind}.delta", {**at, "content_index": 0, "delta": text})
    yield 0, event(f"{kind}.done", {**at, "content_index": 0, "text": " ".join(words)})


def _body(cfg: SimConfig, r: Reply, status: str, output: list[Json]) -> Json:
    req, out = r.prep.meta["request"], r.out
    prompt, done = r.prep.prompt_tokens, out.completion_tokens
    usage = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": r.cached_tokens},
        "output_tokens": done,
        "output_tokens_details": {"reasoning_tokens": len(out.reasoning)},
        "total_tokens": prompt + done,
    }
    return {
        "id": r.rid,
        "object": "response",
        "created_at": r.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req["instructions"],
        "max_output_tokens": req["max_output_tokens"],
        "metadata": r.prep.meta["metadata"],
        "model": cfg.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": req["previous_response_id"],
        "reasoning": req["reasoning"] or {"effort": None, "summary": None},
        "store": r.prep.meta["store"],
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": req["tool_choice"] or "auto",
        "tools": r.prep.meta["tools"],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
    }
