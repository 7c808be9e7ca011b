"""/mcp against a real llama-server with the official MCP client, and the real Claude Code CLI
registering the gateway as its MCP server (`claude mcp add --transport http`, `claude mcp list`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import httpx2
import mcp.types as types
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from bench.support.agents import AgentHome, AgentsMissing, claude_binary, claude_env, require_agents, run_turn
from tests.support.harness import Running, run_gateway
from tests.support.servers import sim_replica

from .backends import LlamaServer

KEY = "mcp-real-key"


def table(url: str) -> str:
    # A long budget: the tiny model's random weights rarely stop, so a call runs until cancelled.
    return f"""
defaults: {{max_tokens: 48, min_max_tokens: 0, params: {{temperature: 0}}}}
presets:
  small:
    served_model: tiny
    replicas: [{{name: r0, url: "{url}", engine: llamacpp}}]
  long:
    served_model: tiny
    max_tokens: 6000
    replicas: [{{name: r0, url: "{url}", engine: llamacpp}}]
tasks: {{extract: small, bulk: long, summarise: small}}
routing: {{default: small}}
"""


@pytest.fixture(scope="module")
def fleet(tiny_gguf: Path) -> Iterator[tuple[LlamaServer, Running]]:
    with (
        LlamaServer(tiny_gguf, slots=1, ctx=8192, name="mcp") as server,
        run_gateway(table(server.url), api_keys=KEY) as gw,
    ):
        yield server, gw


@contextlib.asynccontextmanager
async def session(gw: Running) -> AsyncIterator[ClientSession]:
    async with (
        httpx2.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=120) as http,
        streamable_http_client(gw.url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        yield client


def busy(server: LlamaServer) -> int:
    slots = httpx2.get(server.url + "/slots", timeout=5).json()
    return sum(1 for slot in slots if slot.get("is_processing"))


def text(result: types.CallToolResult) -> str:
    return "".join(c.text for c in result.content if isinstance(c, types.TextContent))


@pytest.mark.anyio
async def test_delegate_and_extract_on_a_real_llama_server(fleet: tuple[LlamaServer, Running]) -> None:
    _, gw = fleet
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    async with session(gw) as client:
        delegated = await client.call_tool(
            "delegate", {"task": "summarise", "prompt": "Say hi", "max_tokens": 8}
        )
        extracted = await client.call_tool("extract", {"prompt": "Is it fine?", "json_schema": schema})
    assert not delegated.is_error, text(delegated)
    figures = delegated.structured_content
    assert figures is not None and figures["preset"] == "small" and figures["replica"] == "r0"
    assert figures["prompt_tokens"] > 0 and 0 < figures["completion_tokens"] <= 8
    # llama-server's grammar from the schema: JSON that the gateway validated before returning it.
    assert not extracted.is_error, text(extracted)
    assert extracted.structured_content is not None
    assert isinstance(extracted.structured_content["ok"], bool)


@pytest.mark.anyio
async def test_cancelling_a_delegation_frees_the_llama_server_slot(
    fleet: tuple[LlamaServer, Running],
) -> None:
    server, gw = fleet
    progress: list[float] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(value)

    async with session(gw) as client:
        with anyio.move_on_after(30) as scope:
            async with anyio.create_task_group() as group:

                async def call() -> None:
                    await client.call_tool(
                        "delegate", {"task": "bulk", "prompt": "Go on"}, progress_callback=on_progress
                    )

                group.start_soon(call)
                while not progress:  # generating: tokens are reported
                    await anyio.sleep(0.05)
                assert await anyio.to_thread.run_sync(busy, server) == 1
                cancelled = time.monotonic()
                group.cancel_scope.cancel()
        assert not scope.cancelled_caught, "the delegation never reported progress"
        freed = None
        with anyio.move_on_after(15):
            while await anyio.to_thread.run_sync(busy, server):
                await anyio.sleep(0.02)
            freed = time.monotonic() - cancelled
    assert freed is not None, "the slot was still busy 15 s after the cancellation"
    print(f"mcp cancellation: llama-server slot free {freed * 1000:.0f} ms after the client cancelled")


@pytest.fixture(scope="module")
def claude() -> None:
    try:
        require_agents()
    except AgentsMissing as exc:
        pytest.fail(f"{exc}", pytrace=False)


@pytest.mark.parametrize("key", [KEY, "wrong-key"])
def test_claude_code_registers_the_gateway_as_its_mcp_server(claude: None, key: str) -> None:
    replica = sim_replica("vllm", "tiny")
    try:
        with run_gateway(table(replica.url), api_keys=KEY) as gw, AgentHome() as home:
            env = claude_env(gw.url, home)
            binary = str(claude_binary())
            header = f"Authorization: Bearer {key}"
            added = run_turn(
                [binary, "mcp", "add", "--transport", "http", "fleet", gw.url + "/mcp", "--header", header],
                env,
                home.project,
                60,
            )
            assert added.returncode == 0, added.describe()
            listed = run_turn([binary, "mcp", "list"], env, home.project, 120)
    finally:
        replica.stop()
    line = next((row for row in listed.stdout.splitlines() if row.startswith("fleet:")), "")
    assert f"{gw.url}/mcp (HTTP)" in line, listed.describe()
    if key == KEY:
        assert "Connected" in line, listed.describe()
    else:
        assert "Connected" not in line, listed.describe()
