"""Every agent's wire format through the gateway, with the official SDKs, against simulated
replicas of both engines: Anthropic Messages (Claude Code), Responses (Codex), embeddings, the
model catalogue, and the edge's answers in each client's own dialect."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import openai
import orjson
import pytest

from tests.support.harness import Running, eventually, run_gateway
from tests.support.servers import ThreadServer, sim_replica

KEY = "fleet-test-key-1"


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, ThreadServer]]:
    servers = {
        "v": sim_replica("vllm", "dense-served", context=4096),
        "l": sim_replica("llamacpp", "small-served", context=8192),
        "e": sim_replica("llamacpp", "embed-served", embeddings=True),
    }
    yield servers
    for server in servers.values():
        server.stop()


def table(fleet: dict[str, ThreadServer]) -> str:
    return f"""
defaults: {{max_tokens: 8192, min_max_tokens: 0}}
presets:
  dense:
    served_model: dense-served
    aliases: [coder, "claude-*opus*", "claude-*sonnet*"]
    replicas: [{{name: v, url: "{fleet["v"].url}", engine: vllm}}]
  small:
    served_model: small-served
    aliases: ["claude-*haiku*", "gpt-*"]
    replicas: [{{name: l, url: "{fleet["l"].url}", engine: llamacpp}}]
  embed:
    served_model: embed-served
    embeddings: true
    replicas: [{{name: e, url: "{fleet["e"].url}", engine: llamacpp}}]
routing: {{default: dense}}
"""


@pytest.fixture(scope="module")
def gw(fleet: dict[str, ThreadServer]) -> Iterator[Running]:
    with run_gateway(table(fleet), api_keys=KEY) as running:
        yield running


@pytest.fixture
def claude(gw: Running) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def codex(gw: Running) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


def last(server: ThreadServer) -> tuple[dict[str, Any], dict[str, str]]:
    stats = httpx2.get(server.url + "/sim/stats").json()
    return orjson.loads(stats["last_bodies"][-1]), stats["last_headers"][
        -1
    ] if "last_headers" in stats else {}


def log_for(gw: Running, endpoint: str) -> list[dict[str, Any]]:
    return [e for e in gw.log_entries() if e.get("endpoint") == endpoint]


# --- Anthropic Messages -------------------------------------------------------------------------


def test_messages_with_claude_codes_own_model_name(
    gw: Running, fleet: dict[str, ThreadServer], claude: anthropic.Anthropic
) -> None:
    raw = claude.messages.with_raw_response.create(
        model="claude-opus-4-8[1m]",
        max_tokens=64000,
        timeout=60,  # the SDK refuses so large a budget without a stream unless told a timeout
        system=[
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=cli;",
            },
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[{"role": "user", "content": "Say hello"}],
        thinking={"type": "adaptive"},  # type: ignore[typeddict-item]
        extra_headers={"anthropic-beta": "claude-code-20250219"},
    )
    message = raw.parse()
    assert message.type == "message" and message.content and message.usage.input_tokens > 0
    assert raw.headers["x-gateway-preset"] == "dense" and raw.headers["x-gateway-route"] == "pattern"
    rewrites = raw.headers["x-gateway-rewrites"]
    assert "billing_header=removed" in rewrites and "thinking=disabled" in rewrites
    body, _ = last(fleet["v"])
    assert body["model"] == "dense-served"
    assert body["thinking"] == {"type": "disabled"}
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["system"] == [
        {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}
    ]
    entry = eventually(lambda: log_for(gw, "messages"))[-1]
    assert entry["status"] == 200 and entry["preset"] == "dense"
    # Capped to what the replica's 4096-token context leaves after the prompt: vLLM refuses 64000.
    assert body["max_tokens"] == 4096 - entry["estimated_tokens"]
    assert f"max_tokens=64000->{body['max_tokens']}" in rewrites


def test_messages_stream_is_relayed_whole_and_counted(gw: Running, claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model="claude-haiku-4-5", max_tokens=64, messages=[{"role": "user", "content": "Say hello"}]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    entry = eventually(lambda: [e for e in log_for(gw, "messages") if e.get("stream")])[-1]
    assert entry["preset"] == "small" and entry["completion_tokens"] == final.usage.output_tokens
    assert 'gateway_endpoint_requests_total{endpoint="messages",status="2xx"}' in gw.metrics()


def test_count_tokens(claude: anthropic.Anthropic) -> None:
    counted = claude.messages.count_tokens(
        model="claude-opus-4-8", messages=[{"role": "user", "content": "hello"}]
    )
    assert counted.input_tokens > 0


@pytest.mark.parametrize("model", ["claude-opus-4-8", "claude-haiku-4-5"])
def test_a_tool_round_trip(claude: anthropic.Anthropic, model: str) -> None:
    tools = [
        {
            "name": "Bash",
            "description": "run",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        }
    ]
    ask = {"role": "user", "content": 'Run it [[tool Bash {"command": "echo fleet-ok"}]]'}
    first = claude.messages.create(model=model, max_tokens=256, tools=tools, messages=[ask])  # type: ignore[list-item,arg-type]
    assert first.stop_reason == "tool_use"
    use = next(block for block in first.content if block.type == "tool_use")
    assert use.name == "Bash" and use.input == {"command": "echo fleet-ok"}
    turns = [
        ask,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "fleet-ok"}]},
    ]
    second = claude.messages.create(model=model, max_tokens=256, tools=tools, messages=turns)  # type: ignore[arg-type]
    text = "".join(block.text for block in second.content if block.type == "text")
    assert "tool result: fleet-ok" in text


def test_system_messages_after_the_first_turn_are_fixed_for_local_templates(
    fleet: dict[str, ThreadServer], claude: anthropic.Anthropic
) -> None:
    raw = claude.messages.with_raw_response.create(
        model="claude-haiku-4-5",
        max_tokens=32,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "<system-reminder>be brief</system-reminder>"},  # type: ignore[typeddict-item]
            {"role": "user", "content": "go"},
        ],
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
    )
    assert "system_in_turns=1" in raw.headers["x-gateway-rewrites"]
    body, _ = last(fleet["l"])
    assert [m["role"] for m in body["messages"]] == ["user", "user", "user"]
    assert "context_management" not in body


def test_anthropic_clients_get_anthropic_errors(gw: Running, claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="claude-opus-4-8", max_tokens=10, messages=[])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(
            model="no-such-model", max_tokens=10, messages=[{"role": "user", "content": "x"}]
        )
    with (
        anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError) as denied,
    ):
        wrong.messages.create(
            model="claude-opus-4-8", max_tokens=10, messages=[{"role": "user", "content": "x"}]
        )
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_the_gateway_key_is_never_forwarded(
    fleet: dict[str, ThreadServer], claude: anthropic.Anthropic
) -> None:
    claude.messages.create(
        model="claude-opus-4-8",
        max_tokens=8,
        messages=[{"role": "user", "content": "x"}],
        extra_headers={"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"},
    )
    stats = httpx2.get(fleet["v"].url + "/sim/stats").json()
    headers = stats["last_headers"][-1]
    assert "x-api-key" not in headers and "authorization" not in headers
    assert headers.get("anthropic-version") == "2023-06-01"  # the engines read both; nothing else goes
    assert headers.get("anthropic-beta") == "claude-code-20250219"


# --- Responses -----------------------------------------------------------------------------------


def test_responses_create_and_stream(
    gw: Running, fleet: dict[str, ThreadServer], codex: openai.OpenAI
) -> None:
    raw = codex.responses.with_raw_response.create(
        model="gpt-5.1-codex", input="Say hello", reasoning={"effort": "low"}
    )
    response = raw.parse()
    assert response.status in ("completed", "incomplete") and response.usage is not None
    assert raw.headers["x-gateway-preset"] == "small"
    body, _ = last(fleet["l"])
    entry = eventually(lambda: log_for(gw, "responses"))[-1]
    # The preset's default budget, capped to what the 8192-token context leaves after the prompt.
    assert body["max_output_tokens"] == 8192 - entry["estimated_tokens"]
    assert body["reasoning"] == {"effort": "low"}
    events = list(codex.responses.create(model="coder", input="Say hello", stream=True))
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    entry = eventually(lambda: [e for e in log_for(gw, "responses") if e.get("stream")])[-1]
    assert entry["preset"] == "dense" and entry["status"] == 200


def test_responses_tool_round_trip(codex: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "name": "shell",
            "description": "run",
            "parameters": {"type": "object", "properties": {}},
        }
    ]
    first = codex.responses.create(
        model="coder", input='go [[tool shell {"command": ["echo", "ok"]}]]', tools=tools
    )  # type: ignore[arg-type]
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "shell" and orjson.loads(call.arguments) == {"command": ["echo", "ok"]}
    second = codex.responses.create(
        model="coder",
        tools=tools,  # type: ignore[arg-type]
        input=[
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": call.call_id, "name": "shell", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "ok-from-shell"},
        ],
    )
    assert "tool result: ok-from-shell" in second.output_text


def test_codex_lite_form_reaches_the_engine_with_plain_tools(
    fleet: dict[str, ThreadServer], codex: openai.OpenAI
) -> None:
    tool = {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}
    raw = codex.responses.with_raw_response.create(
        model="gpt-5.1-codex-mini",
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "additional_tools", "tools": [tool]},  # type: ignore[list-item]
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        extra_headers={"x-openai-internal-codex-responses-lite": "true"},
    )
    assert "additional_tools=1" in raw.headers["x-gateway-rewrites"]
    body, _ = last(fleet["l"])
    assert body["tools"] == [tool] and [i["type"] for i in body["input"]] == ["message", "message"]


def test_a_stored_response_is_read_from_the_replica_that_holds_it(codex: openai.OpenAI) -> None:
    created = codex.responses.create(model="coder", input="remember me")
    again = codex.responses.retrieve(created.id)
    assert again.id == created.id
    with pytest.raises(openai.NotFoundError):
        codex.responses.retrieve("resp_unknown_to_the_gateway")


# --- embeddings, catalogue, edge -------------------------------------------------------------------


def test_embeddings_go_to_the_preset_that_has_them(codex: openai.OpenAI) -> None:
    result = codex.embeddings.create(model="embed", input=["a", "b"])
    assert len(result.data) == 2 and result.data[0].embedding
    defaulted = codex.embeddings.create(model="auto", input="a")
    assert defaulted.data
    with pytest.raises(openai.BadRequestError) as refused:
        codex.embeddings.create(model="coder", input="a")
    assert "presets that do: embed" in refused.value.message and refused.value.code == "endpoint_not_served"


def test_model_catalogue(gw: Running, codex: openai.OpenAI) -> None:
    card = codex.models.retrieve("claude-opus-4-8")
    assert card.id == "claude-opus-4-8" and card.model_extra and card.model_extra["preset"] == "dense"
    listed = httpx2.get(gw.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()
    dense = next(c for c in listed["data"] if c["id"] == "dense")
    assert dense["capabilities"][:2] == ["chat", "tools"] and "claude-*opus*" in dense["aliases"]
    assert dense["context_length"] == 4096
    shaped = httpx2.get(
        gw.url + "/v1/models", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    ).json()
    assert shaped["data"][0]["type"] == "model" and "has_more" in shaped


def test_head_root_answers_without_a_key(gw: Running) -> None:
    assert httpx2.head(gw.url + "/").status_code == 200


def test_unknown_paths_and_methods_are_logged_and_counted(gw: Running) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    assert httpx2.post(gw.url + "/v1/nope", headers=headers, json={}).status_code == 404
    method = httpx2.get(gw.url + "/v1/messages", headers=headers)
    assert method.status_code == 405 and method.json()["type"] == "error"
    assert httpx2.post(gw.url + "/v1/messages", headers={"x-api-key": "bad"}, json={}).status_code == 401
    entries = eventually(lambda: [e for e in gw.log_entries() if e.get("status") in (401, 404, 405)])
    assert {e["status"] for e in entries} >= {401, 404, 405}
    assert any(e["endpoint"] == "other" and e["status"] == 404 for e in entries)
    metrics = gw.metrics()
    assert 'endpoint="other"' in metrics and 'endpoint="messages"' in metrics
