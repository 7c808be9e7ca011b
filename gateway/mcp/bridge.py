"""`fleet-gateway mcp`: the gateway's `/mcp` tools over stdio, for MCP clients that only launch commands.

One stdio server whose tool list and tool calls are forwarded to the gateway's Streamable HTTP
endpoint with the SDK's client: progress comes back as progress, a cancelled call is cancelled
upstream (the SDK's client sends `notifications/cancelled` when its call is abandoned), and the
key travels only in the Authorization header. Logging goes to stderr: stdout is the protocol.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import anyio
import httpx2
import mcp.types as types
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from gateway import __version__


def _server(upstream: ClientSession) -> Server[Any]:
    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return await upstream.list_tools()

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        async def progress(progress: float, total: float | None, message: str | None) -> None:
            await ctx.session.report_progress(progress, total, message)

        try:
            return await upstream.call_tool(params.name, params.arguments or {}, progress_callback=progress)
        except (httpx2.HTTPError, OSError) as exc:
            text = f"The gateway could not be reached: {type(exc).__name__}"
            return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)

    return Server(
        "fleet-gateway-bridge", version=__version__, on_list_tools=list_tools, on_call_tool=call_tool
    )


async def bridge(url: str, key: str | None) -> None:
    endpoint = url.rstrip("/")
    if not endpoint.endswith("/mcp"):
        endpoint += "/mcp"
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx2.AsyncClient(headers=headers, timeout=None))
        read, write = await stack.enter_async_context(streamable_http_client(endpoint, http_client=http))
        upstream = await stack.enter_async_context(ClientSession(read, write))
        await upstream.initialize()
        server = _server(upstream)
        stdin, stdout = await stack.enter_async_context(stdio_server())
        await server.run(stdin, stdout, server.create_initialization_options())


def bridge_command(url: str, key: str | None) -> int:
    try:
        anyio.run(bridge, url, key)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line for the operator, never a trace on stdout
        print(f"fleet-gateway mcp: cannot bridge to {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
