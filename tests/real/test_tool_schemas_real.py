"""Claude Code's and Codex's captured tool lists on the real engines, through the gateway: chat,
Messages and Responses, as the agents send them, answer 200 on llama-server and on vLLM; and the
`tool_schemas` fix turns what each engine refuses (measured, docs/agents.md) into a 200: a keyword
it is known to refuse removed before sending, another refusal retried once without constraints.

The tool lists alone are some 28,000 tokens of the tiny models' byte-level vocabulary, so both
engines run here with a 64k context of their own (vLLM past the checkpoint's 4,096 positions, which
its `VLLM_ALLOW_LONG_MAX_MODEL_LEN` permits; the weights are random anyway).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import orjson
import pytest

from tests.support.harness import Running, run_gateway

from .backends import LlamaServer, VllmServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
CONTEXT = 65536
TIMEOUT = 600.0


class LongVllm(VllmServer):
    """vLLM allowed a context past the checkpoint's positions."""

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}


@pytest.fixture(scope="module")
def llama(tiny_gguf: Path) -> Iterator[LlamaServer]:
    with LlamaServer(tiny_gguf, slots=1, ctx=CONTEXT, name="schemas") as server:
        yield server


@pytest.fixture(scope="module")
def vllm(tiny_hf: Path) -> Iterator[VllmServer]:
    with LongVllm(tiny_hf, "tiny", cpu=1, max_model_len=CONTEXT, ready_timeout=400) as server:
        yield server


def routes(llama: LlamaServer, vllm: VllmServer, compat: str = "") -> str:
    return f"""
defaults: {{max_tokens: 8, min_max_tokens: 0, params: {{temperature: 0}}{compat}}}
presets:
  gguf:
    served_model: tiny-gguf
    replicas: [{{name: llama, url: "{llama.url}", engine: llamacpp}}]
  hf:
    served_model: tiny
    replicas: [{{name: vllm, url: "{vllm.url}", engine: vllm}}]
routing: {{default: gguf}}
"""


@pytest.fixture(scope="module")
def gateway(llama: LlamaServer, vllm: VllmServer) -> Iterator[Running]:
    with run_gateway(routes(llama, vllm)) as running:
        yield running


@pytest.fixture(scope="module")
def bare(llama: LlamaServer, vllm: VllmServer) -> Iterator[Running]:
    """The same fleet with no compatibility fix: what the engines say to the tools as they are."""
    with run_gateway(routes(llama, vllm, ", compat: []")) as running:
        yield running


def captured(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())["body"]  # type: ignore[no-any-return]


def function_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A captured request's tools as an OpenAI chat client declares them (namespaces flattened)."""
    tools = list(body.get("tools") or [])
    for item in body.get("input") or []:
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            tools += item["tools"]
    out = []
    for tool in tools:
        group = tool["tools"] if tool.get("type") == "namespace" else [tool]
        for each in group:
            schema = each.get("input_schema") or each.get("parameters")
            if schema is not None:
                function = {
                    "name": each["name"],
                    "description": each.get("description", ""),
                    "parameters": schema,
                }
                out.append({"type": "function", "function": function})
    return out


def post(gateway: Running, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    """The body as raw bytes (an agent's own serialisation), the answer read to its end."""
    with httpx2.Client(timeout=TIMEOUT) as client:
        response = client.post(
            gateway.url + path, content=orjson.dumps(body), headers={"content-type": "application/json"}
        )
        return response.status_code, dict(response.headers), response.content


def streamed_ok(status: int, data: bytes) -> bool:
    """A stream that ended with its dialect's last event, and no error event on the way."""
    ended = any(
        b"event: " + kind in data for kind in (b"message_stop", b"response.completed", b"response.incomplete")
    )
    failed = b"event: error" in data or b"event: response.failed" in data
    return status == 200 and ended and not failed


ENGINES = [pytest.param("gguf", id="llama-server"), pytest.param("hf", id="vllm")]


@pytest.mark.parametrize("preset", ENGINES)
def test_claude_codes_request_with_its_tools(gateway: Running, preset: str) -> None:
    body = {**captured("claude-code-messages.json"), "model": preset, "max_tokens": 8}
    status, _, data = post(gateway, "/v1/messages", body)
    assert streamed_ok(status, data), data[:500]


@pytest.mark.parametrize("preset", ENGINES)
@pytest.mark.parametrize("name", ["codex-responses.json", "codex-responses-lite.json"])
def test_codexs_request_with_its_tools(gateway: Running, preset: str, name: str) -> None:
    body = {**captured(name), "model": preset}
    status, _, data = post(gateway, "/v1/responses", body)
    assert streamed_ok(status, data), data[:500]


@pytest.mark.parametrize("preset", ENGINES)
@pytest.mark.parametrize("name", ["claude-code-messages.json", "codex-responses.json"])
def test_the_agents_tools_in_chat_form(gateway: Running, preset: str, name: str) -> None:
    body = {
        "model": preset,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": function_tools(captured(name)),
    }
    status, headers, data = post(gateway, "/v1/chat/completions", body)
    assert status == 200, data[:500]
    assert "tool_schemas" not in headers.get("x-gateway-rewrites", "")  # accepted as they came


def tool(schema: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": "lookup", "description": "Looks it up", "parameters": schema}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def chat(gateway: Running, preset: str, tools: list[dict[str, Any]]) -> tuple[int, dict[str, str], bytes]:
    body = {"model": preset, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    return post(gateway, "/v1/chat/completions", body)


LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 5000}}}
EMPTY_CHOICE = {"type": "object", "properties": {"kind": {"anyOf": []}, "name": {"type": "string"}}}
UNICODE = {"type": "object", "properties": {"word": {"type": "string", "pattern": r"^\p{L}+$"}}}


def test_llama_server_refuses_a_long_minimum_and_the_fix_removes_it(gateway: Running, bare: Running) -> None:
    status, _, data = chat(bare, "gguf", [tool(LONG_TEXT)])
    assert status == 400 and b"failed to parse grammar" in data
    status, headers, _ = chat(gateway, "gguf", [tool(LONG_TEXT)])
    assert status == 200 and "keywords_removed=1" in headers["x-gateway-rewrites"]


def test_llama_server_refuses_an_empty_anyof_and_the_retry_drops_its_constraints(
    gateway: Running, bare: Running
) -> None:
    status, _, data = chat(bare, "gguf", [tool(EMPTY_CHOICE)])
    assert status == 400 and b"anyOf: must not be empty" in data
    status, headers, _ = chat(gateway, "gguf", [tool(EMPTY_CHOICE)])
    assert status == 200 and "unconstrained_retry=1" in headers["x-gateway-rewrites"]


def test_vllm_refuses_a_unicode_class_in_a_strict_tool_and_the_fix_removes_it(
    gateway: Running, bare: Running
) -> None:
    status, _, data = chat(bare, "hf", [tool(UNICODE, strict=True)])
    assert status == 400 and b"Invalid grammar specification" in data
    assert chat(bare, "hf", [tool(UNICODE)])[0] == 200  # a tool without `strict` is never compiled
    status, headers, _ = chat(gateway, "hf", [tool(UNICODE, strict=True)])
    assert status == 200 and "keywords_removed=1" in headers["x-gateway-rewrites"]


EMPTY_ENUM = {"type": "object", "properties": {"mode": {"type": "string", "enum": []}}}


def test_vllm_refuses_an_empty_enum_in_a_strict_tool_and_the_retry_sends_it_not_strict(
    gateway: Running, bare: Running
) -> None:
    status, _, data = chat(bare, "hf", [tool(EMPTY_ENUM, strict=True)])
    assert status == 400 and b"Invalid grammar specification" in data
    status, headers, _ = chat(gateway, "hf", [tool(EMPTY_ENUM, strict=True)])
    assert status == 200 and "unconstrained_retry=1" in headers["x-gateway-rewrites"]
