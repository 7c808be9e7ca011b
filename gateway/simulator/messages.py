"""The Anthropic Messages dialect (``/v1/messages``, ``/v1/messages/count_tokens``) of both engines.

Like llama-server (``server_chat_convert_anthropic_to_oai``) and vLLM, a Messages request is turned into a
chat request first (system, tools, then the turns, in order), so it renders, caches, thinks and calls tools
exactly as chat does. Usage follows llama-server: ``input_tokens`` leaves the cached tokens out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson

from gateway.simulator import dialect, engine
from gateway.simulator.dialect import Reply
from gateway.simulator.engine import Prepared, SimConfig
from gateway.types import Json

LLAMA_DEFAULT_MAX_TOKENS = 4096  # llama-server is permissive where Anthropic requires max_tokens
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_shape(cfg: SimConfig, status: int, payload: Json) -> Json:
    """vLLM answers Anthropic-shaped errors here; llama-server keeps its own shape on every endpoint."""
    if cfg.engine != "vllm":
        return payload
    inner = payload.get("error")
    message = inner.get("message") if isinstance(inner, dict) else inner
    etype = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": etype, "message": str(message)}}


# --- request -> chat ---------------------------------------------------------------------------------


def _image(block: Json) -> Json | None:
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = str(source.get("url", ""))
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _parts(blocks: list[Any]) -> list[Json]:
    parts: list[Json] = []
    for block in blocks:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif block.get("type") == "image" and (image := _image(block)) is not None:
            parts.append(image)
    return parts


def _system(system: Any) -> str:
    if isinstance(system, list):
        return "".join(p["text"] for p in _parts(system) if p["type"] == "text")
    return "" if system is None else str(system)


def _turn(msg: Json) -> list[Json]:
    """One Messages turn as chat messages: its tool results first (Anthropic's order), then the rest."""
    role, content = msg.get("role"), msg.get("content")
    if not isinstance(content, list):
        return [{"role": role, "content": content}]
    calls, results = [], []
    for block in content:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_use":
            args = json.dumps(block.get("input", {}), ensure_ascii=False)
            fn = {"name": block.get("name", ""), "arguments": args}
            calls.append({"id": block.get("id", ""), "type": "function", "function": fn})
        elif block.get("type") == "tool_result":
            result = block.get("content")
            text = _parts(result) if isinstance(result, list) else ("" if result is None else str(result))
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": text})
    parts = _parts(content)
    if parts or calls:
        turn: Json = {"role": role, "content": parts or ""}
        if calls:
            turn["tool_calls"] = calls
        results.append(turn)
    return results


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))


def to_chat(cfg: SimConfig, body: Json, counting: bool = False) -> Json:
    """The chat request an engine builds from a Messages request (``counting``: for count_tokens)."""
    turns = body.get("messages")
    if not isinstance(turns, list) or not all(isinstance(m, dict) for m in turns):
        raise engine.bad_request(cfg, "'messages' is required and must be a list of objects", "messages")
    chat: Json = {"model": body.get("model"), "stream": body.get("stream") is True}
    messages: list[Json] = []
    if body.get("system"):
        messages.append({"role": "system", "content": _system(body["system"])})
    for msg in turns:
        messages.extend(_turn(msg))
    chat["messages"] = messages
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [
            {"type": "function", "function": _function(t)}
            for t in tools
            if isinstance(t, dict) and "name" in t
        ]
    if (choice := _tool_choice(body.get("tool_choice"))) is not None:
        chat["tool_choice"] = choice
    if not counting:
        if "max_tokens" in body:
            chat["max_tokens"] = body["max_tokens"]
        elif cfg.engine == "vllm":
            raise engine.bad_request(cfg, "max_tokens: Field required", "max_tokens")
        else:
            chat["max_tokens"] = LLAMA_DEFAULT_MAX_TOKENS
    kwargs = body.get("chat_template_kwargs")
    thinking = body.get("thinking")
    if isinstance(kwargs, dict) or kwargs is None:
        kwargs = dict(kwargs or {})
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if "enable_thinking" not in kwargs and kind in ("enabled", "adaptive", "disabled"):
            kwargs["enable_thinking"] = kind != "disabled"
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if cfg.engine == "vllm" and "cache_salt" in body:
        chat["cache_salt"] = body["cache_salt"]
    return chat


def _function(tool: Json) -> Json:
    fn: Json = {"name": tool.get("name")}
    if "description" in tool:
        fn["description"] = tool["description"]
    fn["parameters"] = tool.get("input_schema", {})
    return fn


def prepare(cfg: SimConfig, raw: bytes, content_type: str | None) -> Prepared:
    body = engine.parse(cfg, raw, content_type)
    return engine.prepare_body(cfg, "chat", to_chat(cfg, body), guess_tools=False)


def count_tokens(cfg: SimConfig, raw: bytes, content_type: str | None) -> Json:
    body = engine.parse(cfg, raw, content_type)
    count = engine.prepare_body(
        cfg, "chat", to_chat(cfg, body, counting=True), guess_tools=False
    ).prompt_tokens
    if cfg.engine == "vllm":
        return {"input_tokens": count, "context_management": {"original_input_tokens": count}}
    return {"input_tokens": count}


# --- reply -> Messages -------------------------------------------------------------------------------


def usage(cfg: SimConfig, r: Reply, output_tokens: int) -> Json:
    fresh = r.prep.prompt_tokens - r.cached_tokens
    out: Json = {"input_tokens": fresh, "cache_read_input_tokens": r.cached_tokens}
    if cfg.engine == "vllm":
        out["cache_creation_input_tokens"] = 0
    out["output_tokens"] = output_tokens
    return out


def _tool_use(r: Reply) -> Json | None:
    call = r.out.tool_call
    if call is None:
        return None
    args = json.loads(call["function"]["arguments"])
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": args,
    }


def _message(cfg: SimConfig, r: Reply, content: list[Json], stop: str | None, output_tokens: int) -> Json:
    return {
        "id": r.rid,
        "type": "message",
        "role": "assistant",
        "model": cfg.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage(cfg, r, output_tokens),
    }


def response(cfg: SimConfig, r: Reply) -> Json:
    out = r.out
    content: list[Json] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": " ".join(out.reasoning), "signature": ""})
    tool_use = _tool_use(r)
    if tool_use is not None:
        content.append(tool_use)
    elif out.content:
        content.append({"type": "text", "text": " ".join(out.content)})
    stop = STOP_REASONS.get(out.finish_reason, "end_turn")
    return _message(cfg, r, content, stop, out.completion_tokens)


def _event(name: str, data: Json) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def stream(cfg: SimConfig, r: Reply) -> Iterator[tuple[int, bytes]]:
    """The SSE events: message_start, each block's start/deltas/stop (a ping after the first start),
    message_delta with the stop reason and output tokens, message_stop. No ``[DONE]``."""
    out, step = r.out, cfg.chunk_tokens
    yield 0, _event("message_start", {"message": _message(cfg, r, [], None, 0)})
    blocks: list[tuple[Json, list[tuple[int, Json]]]] = []
    if out.reasoning:
        deltas = [
            (n, {"type": "thinking_delta", "thinking": t}) for n, t in dialect.chunks(out.reasoning, step)
        ]
        blocks.append(({"type": "thinking", "thinking": "", "signature": ""}, deltas))
    tool_use = _tool_use(r)
    if tool_use is not None:
        args = r.out.tool_call["function"]["arguments"] if r.out.tool_call else "{}"
        deltas = [(out.tool_tokens, {"type": "input_json_delta", "partial_json": args})]
        blocks.append(({**tool_use, "input": {}}, deltas))
    elif out.content:
        deltas = [(n, {"type": "text_delta", "text": t}) for n, t in dialect.chunks(out.content, step)]
        blocks.append(({"type": "text", "text": ""}, deltas))
    for index, (start, deltas) in enumerate(blocks):
        yield 0, _event("content_block_start", {"index": index, "content_block": start})
        if index == 0:
            yield 0, _event("ping", {})
        for count, delta in deltas:
            yield count, _event("content_block_delta", {"index": index, "delta": delta})
        yield 0, _event("content_block_stop", {"index": index})
    if not blocks:
        yield 0, _event("ping", {})
    stop = {"stop_reason": STOP_REASONS.get(out.finish_reason, "end_turn"), "stop_sequence": None}
    yield 0, _event("message_delta", {"delta": stop, "usage": {"output_tokens": out.completion_tokens}})
    yield 0, _event("message_stop", {})


WIRE = dialect.Wire(prepare, response, stream, "msg_", error_shape)
COUNT_TOKENS = dialect.Answer(count_tokens, error_shape)
