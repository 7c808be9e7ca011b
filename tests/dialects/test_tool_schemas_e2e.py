"""Tool schemas through the gateway with the official SDKs, against simulated replicas told to
refuse schema keywords the way the engines refuse a grammar they cannot build
(`refuse_schema_keywords`): the keywords an engine is known to refuse are removed before sending,
another refusal is retried once without constraints on the failing tool, and a tool list the
engine accepts reaches it byte for byte."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import orjson
import pytest

from tests.support.harness import Running, run_gateway
from tests.support.servers import ThreadServer, sim_replica

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
BOUNDED = {
    "type": "object",
    "properties": {"id": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}},
}
PLAIN = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, ThreadServer]]:
    servers = {
        # llama-server refuses any tool whose schema it cannot build; vLLM only strict ones.
        "l": sim_replica(
            "llamacpp", "small-served", context=65536, refuse_schema_keywords=("propertyNames", "minLength")
        ),
        "v": sim_replica("vllm", "dense-served", context=65536, refuse_schema_keywords=("pattern",)),
    }
    yield servers
    for server in servers.values():
        server.stop()


def table(fleet: dict[str, ThreadServer], compat: str = "") -> str:
    return f"""
defaults: {{max_tokens: 64, min_max_tokens: 0{compat}}}
presets:
  small:
    served_model: small-served
    aliases: ["claude-*"]
    replicas: [{{name: l, url: "{fleet["l"].url}", engine: llamacpp}}]
  dense:
    served_model: dense-served
    aliases: ["gpt-*"]
    replicas: [{{name: v, url: "{fleet["v"].url}", engine: vllm}}]
routing: {{default: small}}
"""


@pytest.fixture(scope="module")
def gateway(fleet: dict[str, ThreadServer]) -> Iterator[Running]:
    with run_gateway(table(fleet)) as running:
        yield running


def stats(server: ThreadServer) -> dict[str, Any]:
    return httpx2.get(server.url + "/sim/stats").json()  # type: ignore[no-any-return]


def last_body(server: ThreadServer) -> dict[str, Any]:
    return orjson.loads(stats(server)["last_bodies"][-1])  # type: ignore[no-any-return]


def tools(*schemas: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": f"t{i}", "description": "d", "input_schema": s} for i, s in enumerate(schemas)]


def ask(client: anthropic.Anthropic, schemas: list[dict[str, Any]]) -> Any:
    return client.messages.with_raw_response.create(
        model="claude-haiku-4-5",
        max_tokens=16,
        tools=schemas,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "hello"}],
    )


def test_a_refused_tool_is_retried_once_without_constraints(
    gateway: Running, fleet: dict[str, ThreadServer]
) -> None:
    before = stats(fleet["l"])["requests"]
    with anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0) as client:
        raw = ask(client, tools(PLAIN, BOUNDED))
    assert raw.status_code == 200 and "unconstrained_retry=1" in raw.headers["x-gateway-rewrites"]
    assert stats(fleet["l"])["requests"] == before + 2
    sent = last_body(fleet["l"])["tools"]
    assert sent[0]["input_schema"] == PLAIN  # the tool that was fine, as it came
    assert sent[1]["input_schema"] == {"type": "object", "properties": {"id": {"type": "object"}}}
    assert "propertyNames" in sent[1]["description"]  # its schema, as text for the model


def test_without_the_fix_the_engines_refusal_reaches_the_client(fleet: dict[str, ThreadServer]) -> None:
    with (
        run_gateway(table(fleet, ", compat: [billing_header]")) as running,
        anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0) as client,
        pytest.raises(anthropic.BadRequestError, match="failed to parse grammar"),
    ):
        ask(client, tools(PLAIN, BOUNDED))


def test_what_the_engine_is_known_to_refuse_is_removed_before_sending(
    gateway: Running, fleet: dict[str, ThreadServer]
) -> None:
    before = stats(fleet["l"])["requests"]
    long_input = {"type": "object", "properties": {"text": {"type": "string", "minLength": 5000}}}
    with anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0) as client:
        raw = ask(client, tools(long_input))
    assert raw.status_code == 200 and "keywords_removed=1" in raw.headers["x-gateway-rewrites"]
    assert stats(fleet["l"])["requests"] == before + 1
    assert last_body(fleet["l"])["tools"][0]["input_schema"] == {
        "type": "object",
        "properties": {"text": {"type": "string"}},
    }


def test_claude_codes_captured_tools_reach_the_engine_byte_for_byte(
    gateway: Running, fleet: dict[str, ThreadServer]
) -> None:
    captured = json.loads((FIXTURES / "claude-code-messages.json").read_text())["body"]
    with anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0) as client:
        raw = client.messages.with_raw_response.create(
            model="claude-haiku-4-5",
            max_tokens=16,
            tools=captured["tools"],
            messages=[{"role": "user", "content": "hi"}],
        )
    assert raw.status_code == 200 and "tool_schemas" not in raw.headers.get("x-gateway-rewrites", "")
    assert orjson.dumps(last_body(fleet["l"])["tools"]) == orjson.dumps(captured["tools"])


def test_vllm_strict_tools_are_retried_as_not_strict(
    gateway: Running, fleet: dict[str, ThreadServer]
) -> None:
    strict = {
        "type": "function",
        "name": "lookup",
        "strict": True,
        "parameters": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[0-9]+$"}}},
    }
    loose = {**strict, "name": "other", "strict": False}
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as codex:
        raw = codex.responses.with_raw_response.create(model="gpt-5", input="hi", tools=[loose, strict])  # type: ignore[list-item]
    assert raw.status_code == 200 and "unconstrained_retry=1" in raw.headers["x-gateway-rewrites"]
    sent = last_body(fleet["v"])["tools"]
    assert sent[0] == loose and sent[1] == {**strict, "strict": False}
