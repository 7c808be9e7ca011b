"""Tool calls through the gateway with the official SDKs, against simulated replicas that misbehave as
real models and engines do: calls leaked as text (each model family's form, and inside the thinking)
come back as proper calls in every dialect, whole and streamed, on presets with `tool_call_repair`;
parallel calls with repeated or missing ids come back with ids of their own on any preset; a history
that ends with unanswered calls reaches the engine with a result for each."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import openai
import orjson
import pytest

from tests.support.harness import Running, run_gateway
from tests.support.servers import ThreadServer, sim_replica

KEY = "fleet-test-key-1"
BASH = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
PROMPT = 'List the files [[tool Bash {"command": "ls -la"}]]'
ARGUMENTS = {"command": "ls -la"}
DEFAULT_FIXES = "billing_header, system_in_turns, anthropic_only_fields, codex_lite, codex_tools, reasoning_replay, unknown_tool_types"
ENGINES = ("vllm", "llamacpp")
LEAKS = ("leak_xml", "leak_hermes", "leak_json", "leak_glm", "think_call")


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, ThreadServer]]:
    servers = {engine: sim_replica(engine, f"{engine}-served", reasoning_tokens=4) for engine in ENGINES}
    yield servers
    for server in servers.values():
        server.stop()


def table(fleet: dict[str, ThreadServer]) -> str:
    presets = ""
    for engine, server in fleet.items():
        for name, compat in (
            (engine, f"{DEFAULT_FIXES}, tool_call_repair"),
            (f"{engine}-plain", DEFAULT_FIXES),
        ):
            presets += f"""
  {name}:
    served_model: {engine}-served
    compat: [{compat}]
    replicas: [{{name: r-{name}, url: "{server.url}", engine: {engine}}}]"""
    return f"""
defaults: {{max_tokens: 2048, min_max_tokens: 0}}
presets:{presets}
routing: {{default: vllm}}
"""


@pytest.fixture(scope="module")
def gw(fleet: dict[str, ThreadServer]) -> Iterator[Running]:
    with run_gateway(table(fleet), api_keys=KEY) as running:
        yield running


@pytest.fixture
def misbehave(fleet: dict[str, ThreadServer]) -> Iterator[Any]:
    def set_mode(engine: str, mode: str) -> None:
        answer = httpx2.post(fleet[engine].url + "/sim/config", json={"misbehave": mode}, timeout=10)
        assert answer.status_code == 200, answer.text

    yield set_mode
    for engine in ENGINES:
        set_mode(engine, "")


@pytest.fixture
def oai(gw: Running) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def claude(gw: Running) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0) as client:
        yield client


CHAT_TOOLS: Any = [{"type": "function", "function": {"name": "Bash", "parameters": BASH}}]
MESSAGES_TOOLS: Any = [{"name": "Bash", "description": "Run a command", "input_schema": BASH}]
RESPONSES_TOOLS: Any = [{"type": "function", "name": "Bash", "parameters": BASH, "strict": False}]
USER: Any = [{"role": "user", "content": PROMPT}]


def thinking(mode: str) -> dict[str, Any]:
    """A call in the thinking needs the thinking on (the preset turns it off by default)."""
    return {"chat_template_kwargs": {"enable_thinking": True}} if mode == "think_call" else {}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", LEAKS)
def test_the_openai_sdk_gets_a_leaked_call_as_a_chat_tool_call(
    oai: openai.OpenAI, misbehave: Any, engine: str, mode: str
) -> None:
    misbehave(engine, mode)
    whole = oai.chat.completions.create(
        model=engine, messages=USER, tools=CHAT_TOOLS, extra_body=thinking(mode)
    )
    with oai.chat.completions.stream(
        model=engine, messages=USER, tools=CHAT_TOOLS, extra_body=thinking(mode)
    ) as stream:
        streamed = stream.get_final_completion()
    answers: list[Any] = [whole, streamed]
    for completion in answers:
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls or []
        assert call.function.name == "Bash" and json.loads(call.function.arguments) == ARGUMENTS
        assert call.id.startswith("call_")
        assert not (choice.message.content or "").strip()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", LEAKS)
def test_the_anthropic_sdk_gets_a_leaked_call_as_a_tool_use_block(
    claude: anthropic.Anthropic, misbehave: Any, engine: str, mode: str
) -> None:
    misbehave(engine, mode)
    options: Any = {"model": engine, "max_tokens": 1024, "messages": USER, "tools": MESSAGES_TOOLS}
    if mode == "think_call":
        options["thinking"] = {"type": "enabled", "budget_tokens": 512}
    whole = claude.messages.create(**options)
    with claude.messages.stream(**options) as stream:
        streamed = stream.get_final_message()
    answers: list[Any] = [whole, streamed]
    for message in answers:
        assert message.stop_reason == "tool_use", message
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert use.name == "Bash" and use.input == ARGUMENTS and use.id.startswith("toolu_")
        assert not [b for b in message.content if b.type == "text" and not b.text.strip()]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", LEAKS)
def test_the_openai_sdk_gets_a_leaked_call_as_a_responses_function_call(
    oai: openai.OpenAI, misbehave: Any, engine: str, mode: str
) -> None:
    misbehave(engine, mode)
    options: Any = {"model": engine, "input": PROMPT, "tools": RESPONSES_TOOLS}
    if mode == "think_call":
        options["reasoning"] = {"effort": "medium"}
    whole = oai.responses.create(**options)
    with oai.responses.stream(**options) as stream:
        streamed = stream.get_final_response()
    answers: list[Any] = [whole, streamed]
    for response in answers:
        calls = [i for i in response.output if i.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("Bash", ARGUMENTS)], response.output
        assert not [i for i in response.output if i.type == "message"]


def test_without_the_fix_a_leaked_call_stays_text(oai: openai.OpenAI, misbehave: Any) -> None:
    misbehave("vllm", "leak_xml")
    choice = oai.chat.completions.create(model="vllm-plain", messages=USER, tools=CHAT_TOOLS).choices[0]
    assert choice.finish_reason == "stop" and "<function=Bash>" in (choice.message.content or "")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", ["dup_ids", "missing_ids"])
def test_parallel_calls_with_broken_ids_reach_every_sdk_with_ids_of_their_own(
    oai: openai.OpenAI, claude: anthropic.Anthropic, misbehave: Any, engine: str, mode: str
) -> None:
    misbehave(engine, mode)
    model = f"{engine}-plain"  # whatever the preset's compat
    with oai.chat.completions.stream(model=model, messages=USER, tools=CHAT_TOOLS) as stream:
        chat = stream.get_final_completion().choices[0].message.tool_calls or []
    whole = (
        oai.chat.completions.create(model=model, messages=USER, tools=CHAT_TOOLS)
        .choices[0]
        .message.tool_calls
    )
    with claude.messages.stream(
        model=model, max_tokens=1024, messages=USER, tools=MESSAGES_TOOLS
    ) as messages:
        uses = [b for b in messages.get_final_message().content if b.type == "tool_use"]
    with oai.responses.stream(model=model, input=PROMPT, tools=RESPONSES_TOOLS) as responses:
        items = [i for i in responses.get_final_response().output if i.type == "function_call"]
    for ids in (
        [c.id for c in chat],
        [c.id for c in whole or []],
        [u.id for u in uses],
        [i.call_id for i in items],
    ):
        assert len(ids) == 2 and len(set(ids)) == 2 and all(ids), ids
    assert all(json.loads(c.function.arguments) == ARGUMENTS for c in chat)


def last_body(server: ThreadServer) -> dict[str, Any]:
    stats = httpx2.get(server.url + "/sim/stats", timeout=10).json()
    return orjson.loads(stats["last_bodies"][-1])  # type: ignore[no-any-return]


def test_a_history_that_ends_with_an_unanswered_call_reaches_the_engine_with_a_result(
    fleet: dict[str, ThreadServer], claude: anthropic.Anthropic, oai: openai.OpenAI
) -> None:
    call = {"type": "tool_use", "id": "toolu_interrupted", "name": "Bash", "input": ARGUMENTS}
    history: Any = [*USER, {"role": "assistant", "content": [call]}]
    raw = claude.messages.with_raw_response.create(
        model="llamacpp-plain",
        max_tokens=64,
        messages=history,
        tools=MESSAGES_TOOLS,
    )
    assert "calls_answered=1" in raw.headers["x-gateway-rewrites"]
    sent = last_body(fleet["llamacpp"])["messages"][-1]
    assert sent["role"] == "user" and sent["content"][0]["tool_use_id"] == "toolu_interrupted"
    assert sent["content"][0]["is_error"] is True
    history = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}],
        },
    ]
    oai.chat.completions.create(model="llamacpp-plain", messages=history, tools=CHAT_TOOLS)
    assert last_body(fleet["llamacpp"])["messages"][-1]["tool_call_id"] == "c1"
