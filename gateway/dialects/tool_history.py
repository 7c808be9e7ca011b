"""Tool calls and results in a request's history, in a shape the engines accept.

Measured on the engines the tests install (llama-server b11434 with the tiny model's template and a
Qwen3 template; vLLM 0.32.0 CPU with a Qwen3 template), chat, Messages and Responses alike:

- a history that ends with the assistant's tool calls and no results (an interrupted turn, or a
  client that sends the call back to be continued): llama-server answers 400 "Cannot continue an
  assistant message that contains tool calls." on all three endpoints; vLLM answers 200;
- a call without an id: vLLM answers 400 to a chat tool call without `id` ("Field required");
  llama-server answers 400 "Cannot determine type of 'item'" to a Responses `function_call` or
  `function_call_output` without `call_id`; an empty id is accepted by both;
- an orphaned call in the middle of the history, a result whose call is not there, a result's id
  that matches no call, duplicated ids: both engines accept them (the Qwen3 template renders calls
  and results by position and raises on none of these).

So, whatever the preset's compat, the gateway changes only what would be refused: the calls the
history ends with get a synthetic error result each, and a call (or Responses result) without an id
gets one derived from its position, so the same history maps to the same bytes on every turn and
the prefix cache is kept. Everything else is sent as it came.

Templates that do insist on every call having its result and every result its call (raising on the
first unpaired one, as the real tests' template does) are what the opt-in `tool_pairing` fix is for:
there every unanswered call gets the synthetic result, right after the results that did come, and a
result without its call is dropped.
"""

from __future__ import annotations

from typing import Any

from gateway.dialects.base import Note

# What the model reads in place of a result that never came: it may call the tool again.
INTERRUPTED = "The tool call was interrupted before it returned a result; it did not complete."
_CALLS = {"function_call": "function_call_output", "custom_tool_call": "custom_tool_call_output"}
_RESULTS = frozenset(_CALLS.values())


def tool_history(body: dict[str, Any], form: str, *, strict: bool = False) -> list[Note]:
    """The history rules above for a `chat`, `messages` or `responses` body (copy-on-write);
    `strict`: the `tool_pairing` fix."""
    if form == "chat":
        return _chat(body, strict)
    if form == "messages":
        return _messages(body, strict)
    if form == "responses":
        return _responses(body, strict)
    return []


def _notes(minted: int, answered: int, dropped: int) -> list[Note]:
    parts = [
        f"{name}={count}"
        for name, count in (
            ("ids_minted", minted),
            ("calls_answered", answered),
            ("results_dropped", dropped),
        )
        if count
    ]
    return [("tool_history", ",".join(parts))] if parts else []


# --- chat ---------------------------------------------------------------------------------------


def _chat(body: dict[str, Any], strict: bool) -> list[Note]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return []
    out: list[Any] = []
    minted = answered = dropped = 0
    pending: list[str] = []  # the ids of the last assistant turn's calls without a result yet
    for position, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "tool" and strict:
            given = message.get("tool_call_id")
            if not isinstance(given, str) and pending:
                given = pending[0]  # a result without its id answers the first call waiting
                message = {**message, "tool_call_id": given}
            if given not in pending:
                dropped += 1
                continue
            pending.remove(given)
        elif role != "tool":
            if strict and pending:
                out += [_chat_result(i) for i in pending]
                answered += len(pending)
            pending = []
        calls = message.get("tool_calls") if role == "assistant" else None
        if isinstance(calls, list) and calls:
            # Calls without an id get one from their place; the list is copied only then.
            missing = [
                n for n, c in enumerate(calls) if isinstance(c, dict) and not isinstance(c.get("id"), str)
            ]
            if missing:
                fixed = list(calls)
                for n in missing:
                    fixed[n] = {**calls[n], "id": history_id(position, n)}
                message = {**message, "tool_calls": fixed}
                minted += len(missing)
                calls = fixed
            pending = [str(c.get("id")) for c in calls if isinstance(c, dict)]
        out.append(message)
    last = out[-1] if out else None
    if pending and (strict or (isinstance(last, dict) and last.get("role") == "assistant")):
        out += [_chat_result(i) for i in pending]
        answered += len(pending)
    if not (minted or answered or dropped):
        return []
    body["messages"] = out
    return _notes(minted, answered, dropped)


def _chat_result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": INTERRUPTED}


def history_id(position: int, n: int) -> str:
    """The id of the `n`th call of the history item at `position` that came without one: derived
    from where it is, so every turn sends the same bytes for it."""
    return f"call_h{position}x{n}"


# --- Anthropic Messages -------------------------------------------------------------------------


def _messages(body: dict[str, Any], strict: bool) -> list[Note]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return []
    if not strict:
        last = messages[-1]
        if not (isinstance(last, dict) and last.get("role") == "assistant"):
            return []
        pending = _tool_uses(last)
        if not pending:
            return []
        body["messages"] = [*messages, {"role": "user", "content": [_messages_result(i) for i in pending]}]
        return _notes(0, len(pending), 0)
    out: list[Any] = []
    answered = dropped = 0
    pending = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user" and isinstance(message.get("content"), str) and pending:
            message = {**message, "content": [{"type": "text", "text": message["content"]}]}
        if role == "user" and isinstance(message.get("content"), list):
            content = message["content"]
            # The turn is read once; it is copied only when it changes (a long session's history
            # is almost all turns that answer their calls exactly).
            unpaired = []  # positions of results whose call is not waiting
            for position, block in enumerate(content):
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    if block.get("tool_use_id") not in pending:
                        unpaired.append(position)
                        continue
                    pending.remove(block.get("tool_use_id"))
            dropped += len(unpaired)
            if pending or unpaired:
                # Anthropic's order: the results open the user turn that answers the calls.
                kept = [_messages_result(i) for i in pending]
                kept += [block for position, block in enumerate(content) if position not in unpaired]
                answered += len(pending)
                pending = []
                if not kept:
                    continue
                message = {**message, "content": kept}
        elif pending:
            out.append({"role": "user", "content": [_messages_result(i) for i in pending]})
            answered += len(pending)
            pending = []
        if role == "assistant":
            pending = _tool_uses(message)
        out.append(message)
    if pending:
        out.append({"role": "user", "content": [_messages_result(i) for i in pending]})
        answered += len(pending)
    if not (answered or dropped):
        return []
    body["messages"] = out
    return _notes(0, answered, dropped)


def _tool_uses(message: dict[str, Any]) -> list[Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [b.get("id") for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]


def _messages_result(tool_use_id: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": INTERRUPTED, "is_error": True}


# --- Responses ----------------------------------------------------------------------------------


def _responses(body: dict[str, Any], strict: bool) -> list[Note]:
    items = body.get("input")
    if not isinstance(items, list) or not items:
        return []
    out: list[Any] = []
    minted = answered = dropped = 0
    pending: list[tuple[str, str]] = []  # (call id, the output type that answers it), in order
    trailing: list[str] = []  # the ids of the calls since the last item that is not one
    for position, item in enumerate(items):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind not in _CALLS and kind != "reasoning":
            trailing = []
        if kind in _CALLS:
            if not isinstance(item.get("call_id"), str):
                item = {**item, "call_id": history_id(position, 0)}
                minted += 1
            pending.append((item["call_id"], _CALLS[kind]))
            trailing.append(item["call_id"])
        elif kind in _RESULTS:
            given = item.get("call_id")
            ids = [call_id for call_id, _ in pending]
            if not isinstance(given, str):
                # Paired by position, as the templates render it: the first call still waiting.
                given = ids[0] if ids else history_id(position, 0)
                item = {**item, "call_id": given}
                minted += 1
            if given in ids:
                del pending[ids.index(given)]
            elif strict:
                dropped += 1
                continue
        elif strict and pending and kind != "reasoning":
            out += [_responses_result(call_id, answer) for call_id, answer in pending]
            answered += len(pending)
            pending = []
        out.append(item)
    last = out[-1] if out else None
    if not strict and isinstance(last, dict) and last.get("type") in _CALLS:
        pending = [(call_id, answer) for call_id, answer in pending if call_id in trailing]
    elif not strict:
        pending = []
    out += [_responses_result(call_id, answer) for call_id, answer in pending]
    answered += len(pending)
    if not (minted or answered or dropped):
        return []
    body["input"] = out
    return _notes(minted, answered, dropped)


def _responses_result(call_id: str, kind: str) -> dict[str, Any]:
    return {"type": kind, "call_id": call_id, "output": INTERRUPTED}
