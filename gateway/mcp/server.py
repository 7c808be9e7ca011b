"""`/mcp`: the official SDK's Streamable HTTP server, its four tools run on the gateway's request path.

Sessions are stateful (the SDK's session manager), so a client's `notifications/cancelled` reaches
the tool call it names and interrupts it; the call's request then leaves like any client that
disconnects. The gateway's key middleware sits in front, as for every other endpoint, and the
browser guard (Host, Origin, JSON content type) in open mode; gate.py between them and the SDK
binds each session to its key, caps sessions per key and in all, and bounds a body's size and
arrival time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # a dependency of the mcp SDK
import mcp.types as types
import orjson
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from gateway import __version__
from gateway.fleet.replicas import Fleet
from gateway.mcp import call, schema, tools
from gateway.mcp.gate import McpLimits, Recorder, SessionGate
from gateway.mcp.status import fleet_status
from gateway.types import Receive, Scope, Send

PATH = "/mcp"
INSTRUCTIONS = (
    "A local LLM fleet. Delegate bounded, well-specified work (summaries, extraction, drafts, "
    "image reading) with the tools here; keep reasoning and judgement yourself."
)


class McpEndpoint:
    """The ASGI app for `/mcp` and the session manager's lifetime."""

    def __init__(
        self,
        handle: call.Handler,
        fleet: Callable[[], Fleet],
        speeds: Callable[[], Mapping[str, float | None]],
        limits: McpLimits | None = None,
        record: Recorder | None = None,
    ) -> None:
        self.handle, self.fleet, self.speeds = handle, fleet, speeds
        limits = limits or McpLimits()
        self.server: Server[Any] = Server(
            "fleet-gateway",
            version=__version__,
            instructions=INSTRUCTIONS,
            get_tool_input_schema=lambda name: tools.SCHEMAS.get(name),
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        # Host and Origin checks for every path, /mcp included, are the edge's (edge/browser.py).
        # The gate in front holds the session and body limits; the SDK's own are a backstop.
        self.sessions = StreamableHTTPSessionManager(
            app=self.server,
            session_idle_timeout=limits.session_idle,
            max_request_body_size=limits.max_body_bytes,
            max_sessions=2 * limits.sessions,
        )
        self.gate = SessionGate(self.sessions.handle_request, limits, record)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.sessions.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gate(scope, receive, send)

    async def _list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        described = tools.descriptions(self.fleet().table, self.speeds())
        listed = [
            types.Tool(
                name=name,
                description=described[name],
                input_schema=tools.SCHEMAS[name],
                output_schema=tools.DELEGATE_RESULT if name == tools.DELEGATE else None,
                annotations=types.ToolAnnotations(
                    read_only_hint=name == tools.FLEET_STATUS, open_world_hint=False
                ),
            )
            for name in tools.NAMES
        ]
        return types.ListToolsResult(tools=listed)

    async def _call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        name, args = params.name, params.arguments or {}
        spec = tools.SCHEMAS.get(name)
        if spec is None:
            return _error(f"Unknown tool '{name[:64]}'; the tools are {', '.join(tools.NAMES)}")
        try:
            jsonschema.validate(args, spec)
        except jsonschema.ValidationError as exc:
            return _error(f"Invalid arguments for {name}: {exc.message}")
        if name == tools.FLEET_STATUS:
            status = fleet_status(self.fleet(), self.speeds())
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=orjson.dumps(status).decode())],
                structured_content=status,
            )
        if name == tools.EXTRACT:
            try:
                await asyncio.to_thread(schema.vet, args["json_schema"])
            except schema.SchemaRefused as exc:
                return _error(str(exc))
        table = self.fleet().table
        if name == tools.DELEGATE:
            body = tools.delegate_body(args)
        elif name == tools.EXTRACT:
            body = tools.extract_body(args, table)
        else:
            body = tools.look_body(args)
        outcome = await call.run(
            self.handle,
            body,
            tool=name,
            client_id=_client_id(ctx),
            identity=_scope(ctx).get("gateway.identity"),
            progress=_progress(ctx),
        )
        if outcome.error is not None:
            return _error(f"The fleet could not serve this {name}: {outcome.error}")
        if name == tools.EXTRACT:
            return await _extracted(outcome, args["json_schema"])
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=outcome.text)],
            structured_content=_figures(outcome) if name == tools.DELEGATE else None,
        )


def _figures(outcome: call.Outcome) -> dict[str, Any]:
    return {
        "preset": outcome.preset,
        "replica": outcome.replica,
        "prompt_tokens": outcome.prompt_tokens,
        "cached_tokens": outcome.cached_tokens,
        "completion_tokens": outcome.completion_tokens,
        "seconds": outcome.seconds,
    }


async def _extracted(outcome: call.Outcome, wanted: dict[str, Any]) -> types.CallToolResult:
    try:
        value = orjson.loads(outcome.text)
    except orjson.JSONDecodeError:
        return _error(f"The '{outcome.preset}' preset did not answer with JSON: {outcome.text[:200]!r}")
    problem = await schema.check(value, wanted)
    if problem is not None:
        return _error(f"The '{outcome.preset}' preset's JSON does not satisfy the schema: {problem}")
    # Structured content must be an object; any other JSON value is wrapped.
    structured = value if isinstance(value, dict) else {"value": value}
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=outcome.text)], structured_content=structured
    )


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


def _scope(ctx: Any) -> dict[str, Any]:
    request = getattr(ctx, "request", None)
    return getattr(request, "scope", None) or {}


def _client_id(ctx: Any) -> str:
    scope = _scope(ctx)
    found = scope.get("gateway.client")
    if found:
        return str(found)
    client = scope.get("client")
    return f"ip:{client[0]}" if client else "mcp"


def _progress(ctx: Any) -> call.Progress:
    async def report(tokens: int, message: str) -> None:
        await ctx.session.report_progress(tokens, None, message)

    return report
