"""/mcp with the official MCP client over a real socket, in front of simulated replicas: the tools,
their structured results, errors as tool errors, progress, cancellation and the record of each call."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx2
import mcp.types as types
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.support.harness import Running, eventually, run_gateway
from tests.support.servers import ThreadServer, sim_replica

KEY = "mcp-test-key"
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, ThreadServer]]:
    servers = {
        "dense": sim_replica("vllm", "dense-served"),
        "small": sim_replica("llamacpp", "small-served"),
        "vision": sim_replica("vllm", "vision-served"),
        # Slow: 5 tokens/s in real time, so a call is still generating when it is cancelled.
        "slow": sim_replica("llamacpp", "slow-served", time_scale=1.0, decode_tps=5, answer_tokens=400),
    }
    yield servers
    for server in servers.values():
        server.stop()


def table(fleet: dict[str, ThreadServer]) -> str:
    def replica(name: str, engine: str) -> str:
        return f'[{{name: {name}-r, url: "{fleet[name].url}", engine: {engine}}}]'

    return f"""
defaults: {{max_tokens: 512, min_max_tokens: 0}}
presets:
  dense: {{served_model: dense-served, aliases: [coder], replicas: {replica("dense", "vllm")}}}
  small: {{served_model: small-served, aliases: [extractor], replicas: {replica("small", "llamacpp")}}}
  vision: {{served_model: vision-served, vision: true, replicas: {replica("vision", "vllm")}}}
  slow: {{served_model: slow-served, replicas: {replica("slow", "llamacpp")}}}
tasks: {{code: dense, extract: small, bulk: slow}}
routing: {{default: dense, images: vision}}
"""


@pytest.fixture(scope="module")
def gw(fleet: dict[str, ThreadServer]) -> Iterator[Running]:
    with run_gateway(table(fleet), api_keys=KEY) as running:
        yield running


@contextlib.asynccontextmanager
async def session(gw: Running, key: str | None = KEY) -> AsyncIterator[ClientSession]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        streamable_http_client(gw.url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        yield client


async def until(check: Any, timeout: float = 10.0) -> Any:
    """`eventually` for async tests: polls without blocking the loop the client runs on."""
    with anyio.move_on_after(timeout):
        while not (value := await anyio.to_thread.run_sync(check)):
            await anyio.sleep(0.05)
        return value
    return check()


def text(result: types.CallToolResult) -> str:
    return "".join(c.text for c in result.content if isinstance(c, types.TextContent))


def mcp_log(gw: Running, tool: str) -> list[dict[str, Any]]:
    return [e for e in gw.log_entries() if e.get("endpoint") == "mcp" and e.get("tool") == tool]


@pytest.mark.anyio
async def test_lists_the_four_tools_with_schemas_and_the_tables_presets(gw: Running) -> None:
    async with session(gw) as client:
        listed = await client.list_tools()
    tools = {tool.name: tool for tool in listed.tools}
    assert set(tools) == {"delegate", "extract", "look", "fleet_status"}
    assert tools["delegate"].input_schema["required"] == ["task", "prompt"]
    assert set(tools["delegate"].input_schema["properties"]) == {
        "task",
        "prompt",
        "system",
        "context",
        "max_tokens",
        "preset",
    }
    assert tools["extract"].input_schema["required"] == ["prompt", "json_schema"]
    assert tools["look"].input_schema["required"] == ["image", "prompt"]
    description = tools["delegate"].description or ""
    # Built from the table: every preset and task, and when not to delegate.
    for name in ("dense", "small", "vision", "slow", "code", "extract", "bulk"):
        assert name in description
    assert "do NOT delegate" in description
    assert "'small'" in (tools["extract"].description or "")
    assert "'vision'" in (tools["look"].description or "")


@pytest.mark.anyio
async def test_delegate_runs_on_the_tasks_preset_and_reports_its_figures(gw: Running) -> None:
    async with session(gw) as client:
        result = await client.call_tool(
            "delegate",
            {"task": "code", "prompt": "Write a haiku", "context": "file text", "system": "Be brief"},
        )
    assert not result.is_error, text(result)
    assert text(result).strip()
    figures = result.structured_content
    assert figures is not None
    assert figures["preset"] == "dense" and figures["replica"] == "dense-r"
    assert figures["prompt_tokens"] > 0 and figures["completion_tokens"] > 0
    assert figures["seconds"] >= 0 and figures["cached_tokens"] >= 0
    entries = eventually(lambda: mcp_log(gw, "delegate"))
    assert entries and entries[-1]["preset"] == "dense" and entries[-1]["status"] == 200
    assert entries[-1]["client_id"].startswith("key:")  # the key's name, never the key
    assert 'gateway_mcp_tool_calls_total{status="2xx",tool="delegate"}' in gw.metrics()
    assert 'gateway_endpoint_requests_total{endpoint="mcp",status="2xx"}' in gw.metrics()


@pytest.mark.anyio
async def test_delegate_places_context_before_the_prompt_after_the_system(
    gw: Running, fleet: dict[str, ThreadServer]
) -> None:
    async with session(gw) as client:
        await client.call_tool(
            "delegate", {"task": "code", "prompt": "Summarise it", "context": "THE FILE", "system": "Rules"}
        )
    stats = httpx2.get(fleet["dense"].url + "/sim/stats").json()
    import orjson

    body = orjson.loads(stats["last_bodies"][-1])
    assert body["messages"][0] == {"role": "system", "content": "Rules"}
    assert body["messages"][1]["content"].startswith("THE FILE")
    assert body["messages"][1]["content"].endswith("Summarise it")


@pytest.mark.anyio
async def test_preset_overrides_the_task_and_an_unknown_task_is_a_clear_tool_error(gw: Running) -> None:
    async with session(gw) as client:
        chosen = await client.call_tool("delegate", {"task": "code", "prompt": "hi", "preset": "extractor"})
        unknown = await client.call_tool("delegate", {"task": "poetry", "prompt": "hi"})
        invalid = await client.call_tool("delegate", {"prompt": "no task"})
    assert chosen.structured_content and chosen.structured_content["preset"] == "small"
    assert unknown.is_error and "Unknown task 'poetry'" in text(unknown) and "code" in text(unknown)
    assert "Traceback" not in text(unknown)
    assert invalid.is_error


@pytest.mark.anyio
async def test_extract_returns_validated_structured_content(gw: Running) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    async with session(gw) as client:
        result = await client.call_tool(
            "extract", {"prompt": "Who?", "json_schema": schema, "context": "Ann, 7"}
        )
    assert not result.is_error, text(result)
    assert result.structured_content is not None
    assert isinstance(result.structured_content["name"], str)
    assert isinstance(result.structured_content["age"], int)
    assert eventually(lambda: mcp_log(gw, "extract"))[-1]["preset"] == "small"


@pytest.mark.anyio
async def test_extract_refuses_a_schema_that_refers_to_a_file_or_url_before_sending(
    gw: Running, fleet: dict[str, ThreadServer], tmp_path: Any
) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"const": "TOP-SECRET-VALUE"}')
    before = httpx2.get(fleet["small"].url + "/sim/stats").json()["requests"]
    async with session(gw) as client:
        for ref in (secret.as_uri(), "http://127.0.0.1:9/schema.json"):
            result = await client.call_tool(
                "extract", {"prompt": "Who?", "json_schema": {"allOf": [{"$ref": ref}]}}
            )
            assert result.is_error and "must point inside the schema" in text(result)
            assert "TOP-SECRET" not in text(result)
    assert httpx2.get(fleet["small"].url + "/sim/stats").json()["requests"] == before


@pytest.mark.anyio
async def test_extract_checks_a_backtracking_pattern_against_a_long_answer(gw: Running) -> None:
    # The simulator answers 60 x's; Python's regex engine would take ~2**60 steps on this pattern.
    schema = {"type": "string", "minLength": 60, "pattern": "^(x+)+y$"}
    async with session(gw) as client:
        result = await client.call_tool("extract", {"prompt": "Say it", "json_schema": schema})
        health = httpx2.get(gw.url + "/health")
    assert result.is_error and "does not match" in text(result)
    assert health.status_code == 200


@pytest.mark.anyio
async def test_look_sends_the_image_to_the_vision_preset(gw: Running, fleet: dict[str, ThreadServer]) -> None:
    async with session(gw) as client:
        result = await client.call_tool("look", {"image": PNG, "prompt": "What is this?"})
    assert not result.is_error, text(result)
    assert eventually(lambda: mcp_log(gw, "look"))[-1]["preset"] == "vision"
    import orjson

    body = orjson.loads(httpx2.get(fleet["vision"].url + "/sim/stats").json()["last_bodies"][-1])
    assert body["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")


@pytest.mark.anyio
async def test_fleet_status_is_one_entry_per_preset(gw: Running) -> None:
    async with session(gw) as client:
        result = await client.call_tool("fleet_status", {})
    status = result.structured_content
    assert status is not None
    entries = {entry["name"]: entry for entry in status["presets"]}
    assert set(entries) == {"dense", "small", "vision", "slow"}
    small = entries["small"]
    assert small["aliases"] == ["extractor"] and small["tasks"] == ["extract"]
    assert "chat" in small["capabilities"] and "vision" in entries["vision"]["capabilities"]
    assert small["ready"] is True and small["queued"] == 0 and small["in_flight"] == 0
    assert "context_length" in small and "decode_tokens_per_second" in small


@pytest.mark.anyio
async def test_no_key_is_refused(gw: Running) -> None:
    response = httpx2.post(gw.url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert response.status_code == 401
    assert "API key" in response.json()["error"]["message"]


@pytest.mark.anyio
async def test_progress_arrives_while_a_delegation_generates(gw: Running) -> None:
    seen: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, message))

    async with session(gw) as client:
        result = await client.call_tool(
            "delegate", {"task": "bulk", "prompt": "long", "max_tokens": 8}, progress_callback=on_progress
        )
    assert not result.is_error, text(result)
    assert seen, "no progress notification"
    assert all(b >= a for (a, _), (b, _) in itertools.pairwise(seen))
    assert "tokens" in (seen[-1][1] or "")


@pytest.mark.anyio
async def test_cancellation_closes_the_upstream_request(gw: Running, fleet: dict[str, ThreadServer]) -> None:
    def active() -> int:
        return int(httpx2.get(fleet["slow"].url + "/sim/stats").json().get("in_flight", 0))

    async with session(gw) as client:
        with anyio.move_on_after(1.5):
            await client.call_tool("delegate", {"task": "bulk", "prompt": "go on and on"})
        # The client abandoned the call (the SDK sends notifications/cancelled).
        assert await until(lambda: active() == 0)
    entry = eventually(lambda: mcp_log(gw, "delegate") and mcp_log(gw, "delegate")[-1], timeout=10)
    assert entry["outcome"] == "client_disconnected"


@pytest.mark.anyio
async def test_the_stdio_bridge_forwards_tools_and_calls(gw: Running) -> None:
    from pathlib import Path

    from mcp.client.stdio import StdioServerParameters, stdio_client

    repo = Path(__file__).resolve().parents[2]
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "gateway", "mcp", "--url", gw.url],
        env={"GATEWAY_KEY": KEY, "PYTHONPATH": str(repo)},
        cwd=str(repo),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
        await client.initialize()
        listed = await client.list_tools()
        result = await client.call_tool("delegate", {"task": "code", "prompt": "hi"})
    assert {tool.name for tool in listed.tools} == {"delegate", "extract", "look", "fleet_status"}
    assert not result.is_error, text(result)
    assert result.structured_content and result.structured_content["preset"] == "dense"


@pytest.mark.anyio
async def test_the_stdio_bridge_without_the_key_says_why(gw: Running) -> None:
    import subprocess

    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "gateway", "mcp", "--url", gw.url],
            input=b"",
            capture_output=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "GATEWAY_KEY"},
        )
    )
    assert done.returncode == 1
    assert b"cannot bridge" in done.stderr and b"Traceback" not in done.stderr
    assert done.stdout == b""


@pytest.mark.anyio
async def test_a_tool_call_is_a_request_of_the_key_that_opened_the_session(
    fleet: dict[str, ThreadServer],
) -> None:
    """A named key's presets and usage hold for its MCP calls as for its own requests."""
    digest = hashlib.sha256(b"eval-key").hexdigest()
    keys = json.dumps([{"name": "eval", "key_sha256": digest, "presets": ["small"], "priority": "batch"}])
    with run_gateway(table(fleet) + f"keys: {keys}\n") as keyed:
        async with session(keyed, key="eval-key") as client:
            allowed = await client.call_tool("delegate", {"task": "extract", "prompt": "hi"})
            denied = await client.call_tool("delegate", {"task": "code", "prompt": "hi"})
        assert not allowed.is_error, text(allowed)
        assert denied.is_error and "may not use preset 'dense'" in text(denied)
        entries = await until(lambda: [e for e in mcp_log(keyed, "delegate") if e["status"] == 200])
        assert [(e["key"], e["priority"], e["preset"]) for e in entries] == [("eval", "batch", "small")]


@pytest.mark.anyio
async def test_a_max_tokens_past_what_an_engine_reads_is_a_tool_error_not_a_protocol_error(
    gw: Running,
) -> None:
    async with session(gw) as client:
        result = await client.call_tool("delegate", {"task": "code", "prompt": "hi", "max_tokens": 2**70})
    assert result.is_error and "is greater than the maximum" in text(result)
