"""The request bodies: the small chat requests of wrk and the clients, and the big ones of the
body-size test (a 16k-token conversation, image requests of a given size)."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

SYSTEM_PROMPT = (
    "You are a senior software engineer working in the user's repository through tools. Read the "
    "relevant files before changing them, keep changes small and explain each one. Prefer the "
    "standard library; follow the project's style; run the tests after every change."
)
SMALL_MESSAGES = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {"role": "user", "content": "Write a Python function that merges two sorted lists in linear time."},
]


def chat_body(model: str, stream: bool, messages: list[dict[str, Any]] | None = None) -> bytes:
    payload: dict[str, Any] = {"model": model, "messages": messages or SMALL_MESSAGES}
    if stream:
        payload["stream"] = True
    # Compact separators: the instant upstream recognises streams by the bytes `"stream":true`.
    return json.dumps(payload, separators=(",", ":")).encode()


SMALL_BODY = chat_body("bench", stream=False)
STREAM_BODY = chat_body("bench", stream=True)
HOLD_BODY = chat_body("hold", stream=True)


# ---------------------------------------------------------------------------------------------
# Request bodies for the body-size test


def conversation_16k() -> list[dict[str, Any]]:
    """About 16k tokens (~64 KB) of a coding agent's conversation: a long system prompt with a date
    (volatile content, so `warn` has something to find), tool calls, file contents, answers."""
    code = "\n".join(
        f"def handler_{i}(request: Request, limit: int = {i * 7 % 97}) -> Response:\n"
        f'    """Serve route {i}: validate, look up the record, render it."""\n'
        f"    record = store.get(request.path_params['id'], default=None)\n"
        f"    if record is None or record.size > limit:\n"
        f"        raise HTTPException(404, detail=f'no record {{request.url}}')\n"
        f"    return JSONResponse({{'id': record.id, 'rank': {i}, 'tags': sorted(record.tags)}})\n"
        for i in range(12)
    )
    system = (
        SYSTEM_PROMPT + " Today's date: 2026-12-02. " + "Repository conventions: typed Python 3.11, "
        "ruff, pytest; never commit secrets; document every public function. " * 20
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    turn = 0
    while len(json.dumps(messages)) < 64_000:
        turn += 1
        messages.append({"role": "user", "content": f"Step {turn}: look at app/routes_{turn}.py and fix it."})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{turn}",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": f'{{"path": "app/routes_{turn}.py"}}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": code})
        messages.append(
            {
                "role": "assistant",
                "content": f"In routes_{turn}.py the limit check rejects records of exactly the limit "
                "size; the comparison should be `>=`... " * 6,
            }
        )
    return messages


def image_body(total: int) -> bytes:
    """A vision request of `total` bytes: a question and one base64 image part (random bytes)."""
    head = chat_body("bench", stream=False, messages=[{"role": "user", "content": "X"}])
    # Fill the image so the whole body is exactly `total` bytes.
    template = [
        {"type": "text", "text": "What is wrong in this screenshot?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
    ]
    skeleton = head.replace(b'"X"', json.dumps(template, separators=(",", ":")).encode())
    room = total - len(skeleton)
    data = base64.b64encode(os.urandom(room * 3 // 4 + 3))[:room]
    body = skeleton.replace(b"base64,", b"base64," + data, 1)
    assert len(body) == total
    return body
