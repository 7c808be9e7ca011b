"""The agents' wire formats through the gateway to real engines, with the official SDKs: the
Anthropic SDK over /v1/messages (create, stream, count_tokens, a tool-use round trip), the openai
SDK's responses (create, stream, tools) and embeddings, on llama-server and vLLM.

The tiny models' text is random bytes: tests check protocol, routing, usage and the gateway's
record. Streams use temperature 0 on a prompt checked to start with a whole UTF-8 character, since
with a byte-level vocabulary llama-server may drop `message_start` when the first sampled token is
an incomplete UTF-8 byte (docs/engines.md §10).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from tests.support.harness import Running, eventually, run_gateway

from .backends import LlamaServer, VllmServer

TOOLS = [
    {
        "name": "Bash",
        "description": "Run a shell command",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    }
]
FUNCTION = {
    "type": "function",
    "name": "shell",
    "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}


@pytest.fixture(scope="module")
def embedder(tiny_gguf: Path) -> Iterator[LlamaServer]:
    with LlamaServer(
        tiny_gguf, slots=1, ctx=4096, extra_args=("--embeddings", "--pooling", "mean"), name="emb"
    ) as s:
        yield s


def routes(llama: LlamaServer, session: LlamaServer, vllm: VllmServer, embedder: LlamaServer) -> str:
    return f"""
defaults: {{max_tokens: 16, min_max_tokens: 0, params: {{temperature: 0}}}}
presets:
  gguf:
    served_model: tiny-gguf
    aliases: ["claude-*haiku*", "gpt-*"]
    replicas: [{{name: llama-a, url: "{llama.url}", engine: llamacpp}}]
  session:
    served_model: tiny-gguf
    aliases: ["claude-*sonnet*"]
    policy: session
    replicas: [{{name: llama-s, url: "{session.url}", engine: llamacpp}}]
  hf:
    served_model: tiny
    aliases: ["claude-*opus*", "codex-*"]
    replicas: [{{name: vllm-0, url: "{vllm.url}", engine: vllm}}]
  embed:
    served_model: tiny-embed
    embeddings: true
    replicas: [{{name: llama-emb, url: "{embedder.url}", engine: llamacpp}}]
routing: {{default: gguf}}
"""


@pytest.fixture(scope="module")
def gateway(
    llama_pair: tuple[LlamaServer, LlamaServer], vllm_replica: VllmServer, embedder: LlamaServer
) -> Iterator[Running]:
    with run_gateway(routes(*llama_pair, vllm_replica, embedder)) as running:
        yield running


@pytest.fixture(scope="module")
def claude(gateway: Running) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def codex(gateway: Running) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


ENGINES = [
    pytest.param("claude-haiku-4-5", "gguf", id="llama-server"),
    # `policy: session`: sent to llama-server's chat endpoint, pinned to a slot, answered as Messages.
    pytest.param("claude-sonnet-4-5", "session", id="llama-server-as-chat"),
    pytest.param("claude-opus-4-8", "hf", id="vllm"),
]
RESPONSE_MODELS = [
    pytest.param("gpt-5-mini", "gguf", id="llama-server"),
    pytest.param("codex-x", "hf", id="vllm"),
]


def entries(gateway: Running, endpoint: str, preset: str) -> list[dict[str, Any]]:
    return [e for e in gateway.log_entries() if e.get("endpoint") == endpoint and e.get("preset") == preset]


@pytest.mark.parametrize(("model", "preset"), ENGINES)
def test_messages_create(gateway: Running, claude: anthropic.Anthropic, model: str, preset: str) -> None:
    raw = claude.messages.with_raw_response.create(
        model=model, max_tokens=8, messages=[{"role": "user", "content": "Hello there"}]
    )
    message = raw.parse()
    assert message.type == "message" and message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert raw.headers["x-gateway-preset"] == preset
    record = eventually(lambda: entries(gateway, "messages", preset))[-1]
    assert record["status"] == 200 and record["prompt_tokens"] >= message.usage.input_tokens


@pytest.mark.parametrize(("model", "preset"), ENGINES)
def test_messages_stream(gateway: Running, claude: anthropic.Anthropic, model: str, preset: str) -> None:
    with claude.messages.stream(
        model=model, max_tokens=8, messages=[{"role": "user", "content": "Hello there"}]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "message_start" in kinds and kinds[-1] == "message_stop"
    assert final.usage.output_tokens > 0
    record = eventually(lambda: [e for e in entries(gateway, "messages", preset) if e["stream"]])[-1]
    assert record["status"] == 200 and record["completion_tokens"] == final.usage.output_tokens


@pytest.mark.parametrize(("model", "preset"), ENGINES)
def test_count_tokens(claude: anthropic.Anthropic, model: str, preset: str) -> None:
    counted = claude.messages.count_tokens(model=model, messages=[{"role": "user", "content": "Hello there"}])
    assert counted.input_tokens > 0


@pytest.mark.parametrize(("model", "preset"), ENGINES)
def test_a_tool_use_round_trip_is_accepted(claude: anthropic.Anthropic, model: str, preset: str) -> None:
    """The tiny model cannot choose a tool; the round trip's second request (the agent's tool_use
    and its tool_result) is what must reach the engine and come back as an answer."""
    turns: Any = [
        {"role": "user", "content": "List the files"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]},
    ]
    message = claude.messages.create(model=model, max_tokens=8, tools=TOOLS, messages=turns)  # type: ignore[arg-type]
    assert message.type == "message" and message.usage.input_tokens > 0


@pytest.mark.parametrize(("model", "preset"), RESPONSE_MODELS)
def test_responses_create_and_stream(gateway: Running, codex: openai.OpenAI, model: str, preset: str) -> None:
    raw = codex.responses.with_raw_response.create(model=model, input="Hello there")
    response = raw.parse()
    assert response.object == "response" and response.usage is not None and response.usage.input_tokens > 0
    assert raw.headers["x-gateway-preset"] == preset
    events = list(codex.responses.create(model=model, input="Hello there", stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    record = eventually(lambda: [e for e in entries(gateway, "responses", preset) if e["stream"]])[-1]
    assert record["status"] == 200 and record["prompt_tokens"] and record["prompt_tokens"] > 0


@pytest.mark.parametrize(("model", "preset"), RESPONSE_MODELS)
def test_responses_with_tools_and_a_function_result(codex: openai.OpenAI, model: str, preset: str) -> None:
    response = codex.responses.create(
        model=model,
        tools=[FUNCTION],  # type: ignore[list-item]
        input=[
            {"role": "user", "content": "List the files"},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd": "ls"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
        ],
    )
    assert response.object == "response" and response.usage is not None


def test_embeddings_on_llama_server(codex: openai.OpenAI) -> None:
    result = codex.embeddings.create(model="embed", input=["hello", "world"])
    assert len(result.data) == 2 and len(result.data[0].embedding) == 64  # the tiny model's n_embd


def test_embeddings_are_refused_for_a_preset_without_them(codex: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        codex.embeddings.create(model="hf", input="hello")
    assert refused.value.code == "endpoint_not_served"


def idle(server: LlamaServer) -> bool:
    slots = httpx2.get(server.url + "/slots", timeout=5).json()
    return not any(slot.get("is_processing") for slot in slots)


def test_cached_tokens_are_read_from_a_messages_stream(
    gateway: Running, claude: anthropic.Anthropic, llama_pair: tuple[LlamaServer, LlamaServer]
) -> None:
    system = "You are a careful assistant. " * 120
    ids = []
    for _ in range(2):
        # llama-server frees a slot a moment after its stream's last event: a request sent at once can
        # find that slot still busy and take the other one, which holds nothing of this prompt.
        assert eventually(lambda: idle(llama_pair[0]), timeout=30)
        with claude.messages.stream(
            model="claude-haiku-4-5",
            max_tokens=4,
            system=system,
            messages=[{"role": "user", "content": "Hello there"}],
        ) as stream:
            stream.get_final_message()
            ids.append(stream.response.headers["x-request-id"])

    def second() -> dict[str, Any] | None:
        # The access log is written in batches: the first turn's record may be there before this one.
        return next((e for e in entries(gateway, "messages", "gguf") if e["request_id"] == ids[1]), None)

    last = eventually(second)
    assert last is not None, "the second request's record never came"
    assert last["stream"] and last["cached_tokens"] and last["cached_tokens"] > 0.8 * last["prompt_tokens"], (
        last
    )


def test_a_placed_claude_code_session_goes_as_chat_and_finds_its_prompt_in_its_slot(
    gateway: Running, claude: anthropic.Anthropic
) -> None:
    system = "You are a careful assistant. " * 120
    session = {"x-claude-code-session-id": "7d0c2d9e-4a61-4bb4-9d1e-2f4f0c3b6a11"}

    usages, ids = [], []
    for _ in range(2):
        with claude.messages.stream(
            model="claude-sonnet-4-5",
            max_tokens=4,
            system=system,
            tools=TOOLS,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "Hello there"}],
            extra_headers=session,
        ) as stream:
            usages.append(stream.get_final_message().usage)
            ids.append(stream.response.headers["x-request-id"])

    def mine() -> list[dict[str, Any]] | None:
        # The access log is written in batches: wait for both of this test's records.
        found = {e["request_id"]: e for e in entries(gateway, "messages", "session")}
        return [found[i] for i in ids] if all(i in found for i in ids) else None

    records = eventually(mine)
    assert [r["upstream"] for r in records] == ["chat-stream", "chat-stream"]
    # The second turn was pinned to the slot the first one filled: no wait for idle slots needed.
    assert (
        usages[1].cache_read_input_tokens
        and usages[1].cache_read_input_tokens > 0.8 * records[1]["prompt_tokens"]
    )
    assert records[1]["cached_tokens"] == usages[1].cache_read_input_tokens
    assert usages[0].input_tokens + (usages[0].cache_read_input_tokens or 0) == records[0]["prompt_tokens"]
