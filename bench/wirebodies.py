"""Request bodies for `bench.wire`, shaped like a coding agent's: Claude Code's Messages requests,
Codex's Responses requests and the same conversation as a chat-completions request.

Two sizes. `first`: a first turn, ~80 KB: Claude Code's system prompt of three text blocks and ~24
tools with JSON schemas (the captured request in tests/fixtures/agents has 12; 12 more are made up
in the same style). `late`: ~1 MB, late in a session: the first turn plus many turns of tool use
(`tool_use` / `tool_result` blocks; `function_call` / `function_call_output` items for Responses;
`tool_calls` / `tool` messages for chat). Everything is generated from a fixed seed, so every run
sends the same bytes.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from bench.proxycost.constants import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "agents"
SIZES = {"first": 80_000, "late": 1_000_000}  # bytes, approximately (`late` overshoots by < 1 turn)
TOOLS = 24  # in every body, as Claude Code sends in a first turn
_WORDS = (
    "the file path function returns value when called with a list of arguments and the result is "
    "written to output unless the caller asks for a dry run which only prints what would change "
    "tests must pass before commit use absolute paths prefer the dedicated tool over shell commands "
    "read the whole file first then edit only the lines that need it keep the diff small"
)
_CODE = (
    "def class return import self value test if else for while yield async await raise try except "
    "with as from lambda None True False dict list str int len range print open path json"
)
WORDS, CODE = tuple(_WORDS.split()), tuple(_CODE.split())
EXTRA_TOOLS = (
    "Glob",
    "Grep",
    "MultiEdit",
    "NotebookEdit",
    "NotebookRead",
    "TodoWrite",
    "WebFetch",
    "WebSearch",
    "BashOutput",
    "KillShell",
    "ExitPlanMode",
    "AskUserQuestion",
)


def _load(name: str) -> dict[str, Any]:
    captured: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return copy.deepcopy(captured["body"])


def _size(body: dict[str, Any]) -> int:
    return len(dump(body))


def dump(body: dict[str, Any]) -> bytes:
    """As the agents send it: compact JSON, UTF-8."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _prose(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:chars]


def _code(rng: random.Random, lines: int) -> str:
    return "\n".join(
        f"{n:>6}\t"
        + " " * (4 * rng.randrange(4))
        + " ".join(rng.choice(CODE) for _ in range(rng.randrange(3, 12)))
        for n in range(1, lines + 1)
    )


def _schema(rng: random.Random, name: str) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for i in range(rng.randrange(3, 8)):
        key = f"{name.lower()}_{rng.choice(WORDS)}_{i}"
        kind = rng.choice(("string", "integer", "boolean", "array", "enum"))
        if kind == "array":
            spec: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
        elif kind == "enum":
            spec = {"type": "string", "enum": [rng.choice(WORDS) for _ in range(4)]}
        else:
            spec = {"type": kind}
        spec["description"] = _prose(rng, rng.randrange(40, 200))
        properties[key] = spec
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": properties,
        "required": sorted(properties)[:2],
        "additionalProperties": False,
    }


def _extra_tools(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """Made-up tools in Claude Code's shape (name, description, input_schema), descriptions empty
    until `_pad` fills them to the size wanted."""
    return [
        {"name": name, "description": "", "input_schema": _schema(rng, name)}
        for name in (EXTRA_TOOLS * 2)[:count]
    ]


def _pad(body: dict[str, Any], tools: list[dict[str, Any]], rng: random.Random, target: int) -> None:
    """Fill the made-up tools' descriptions so that the body is `target` bytes, give or take a few."""
    room = max(0, target - _size(body))
    for i, tool in enumerate(tools):
        share = room // (len(tools) - i)
        tool["description"] = _prose(rng, share)
        room = max(0, target - _size(body))


# --- Anthropic Messages (Claude Code) --------------------------------------------------------------


def messages_body(size: str, model: str) -> dict[str, Any]:
    rng = random.Random(f"messages-{size}")
    body = _load("claude-code-messages.json")
    body["model"] = model
    extra = _extra_tools(rng, TOOLS - len(body["tools"]))
    body["tools"] = body["tools"] + extra
    _pad(body, extra, rng, SIZES["first"])
    if size == "late":
        _late_messages(body, rng, SIZES["late"])
    return body


def _late_messages(body: dict[str, Any], rng: random.Random, target: int) -> None:
    messages: list[dict[str, Any]] = body["messages"]
    turn, size = 0, _size(body)
    while size < target:
        turn += 1
        call = f"toolu_{rng.getrandbits(96):024x}"
        name = rng.choice(("Read", "Bash", "Edit", "Grep"))
        if name == "Bash":
            tool_input: dict[str, Any] = {"command": f"pytest -q tests/test_{rng.choice(WORDS)}.py"}
        else:
            tool_input = {"file_path": f"/home/user/project/src/{rng.choice(WORDS)}_{turn}.py"}
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": _prose(rng, rng.randrange(60, 400))},
                    {"type": "tool_use", "id": call, "name": name, "input": tool_input},
                ],
            }
        )
        result: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": call,
            "content": _code(rng, rng.randrange(60, 240)),
            "is_error": False,
        }
        messages.append({"role": "user", "content": [result]})
        size += len(dump(messages[-2])) + len(dump(messages[-1])) + 2
    # Claude Code marks the newest block for the prompt cache.
    messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}


# --- chat completions: the same conversation, OpenAI-shaped -----------------------------------------


def chat_body(size: str, model: str) -> dict[str, Any]:
    """The Messages body of the same size, as an OpenAI-compatible agent would send it."""
    source = messages_body(size, model)
    system = "\n\n".join(block["text"] for block in source["system"])
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for message in source["messages"]:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        texts = [block["text"] for block in content if block.get("type") == "text"]
        if message["role"] == "system":  # Claude Code's mid-conversation system block: into the prompt
            messages[0]["content"] += "\n\n" + "\n".join(texts)
        elif message["role"] == "assistant":
            calls = [
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
                }
                for block in content
                if block.get("type") == "tool_use"
            ]
            turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
        else:
            for block in content:
                if block.get("type") == "tool_result":
                    messages.append(
                        {"role": "tool", "tool_call_id": block["tool_use_id"], "content": block["content"]}
                    )
            if texts:
                messages.append({"role": "user", "content": "\n".join(texts)})
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": tool["description"],
                "parameters": tool["input_schema"],
            },
        }
        for tool in source["tools"]
    ]
    return {
        "model": model,
        "messages": messages,
        "tools": tools,
        "max_tokens": 32000,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# --- Responses (Codex) -----------------------------------------------------------------------------


def responses_body(size: str, model: str) -> dict[str, Any]:
    rng = random.Random(f"responses-{size}")
    body = _load("codex-responses.json")
    body["model"] = model
    extra = [
        {
            "type": "function",
            "name": tool["name"],
            "description": "",
            "strict": False,
            "parameters": tool["input_schema"],
        }
        for tool in _extra_tools(rng, TOOLS - len(body["tools"]))
    ]
    body["tools"] = body["tools"] + extra
    _pad(body, extra, rng, SIZES["first"])
    if size == "late":
        _late_responses(body, rng, SIZES["late"])
    return body


def _late_responses(body: dict[str, Any], rng: random.Random, target: int) -> None:
    items: list[dict[str, Any]] = body["input"]
    turn, size, counted = 0, _size(body), len(items)
    while size < target:
        turn += 1
        call = f"call_{rng.getrandbits(96):024x}"
        if turn % 4 == 0:
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": _prose(rng, rng.randrange(60, 400))}],
                }
            )
        command = rng.choice(("sed -n 1,200p", "cat", "rg -n def"))
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{rng.getrandbits(96):024x}",
                "status": "completed",
                "name": "exec_command",
                "arguments": json.dumps({"cmd": f"{command} src/{rng.choice(WORDS)}_{turn}.py"}),
                "call_id": call,
            }
        )
        output = _code(rng, rng.randrange(60, 240))
        items.append(
            {
                "type": "function_call_output",
                "call_id": call,
                "output": f"Chunk ID: {rng.getrandbits(24):06x}\nWall time: 0.0100 seconds\n"
                f"Process exited with code 0\nOriginal token count: {len(output) // 4}\nOutput:\n{output}",
            }
        )
        size += sum(len(dump(item)) + 1 for item in items[counted:])
        counted = len(items)


BUILDERS = {"chat": chat_body, "messages": messages_body, "responses": responses_body}


def build(api: str, size: str, model: str) -> bytes:
    return dump(BUILDERS[api](size, model))
