"""The context contract with the real agents: the settings `fleet-gateway connect` prints are the
ones Claude Code 2.1.332 and Codex 0.171.0 honour, and Codex reads the gateway-shaped catalogue.

Each agent runs headless (scratch HOME, dummy key) against a scripted server on 127.0.0.1 that
answers a few tool rounds and reports, on the last round, a prompt size just above or below the
point where the printed settings should make the agent compact. Compaction shows on the wire: the
agent sends one more request that asks for a summary, and the conversation that follows is shorter
than the one before it. docs/agents.md ("What the agents expect (verified)") has the rest.
"""

from __future__ import annotations

import json
import tomllib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.support.agents import (
    AgentHome,
    AgentsMissing,
    codex_binary,
    codex_env,
    require_agents,
    run_claude,
    run_turn,
)
from gateway.ops import catalogue
from gateway.tools.connect import (
    PresetInfo,
    claude_compact_threshold,
    codex_compact_limit,
    output_budget,
    render,
)
from tests.support.servers import ThreadServer

CONTEXT = 32768
# Claude Code's own prompt and tools take 15k-20k tokens: connect prints a window only from a
# context whose compaction point leaves room for a conversation (64k here; below it the gateway's
# overflow answer drives compaction, tests/real/test_agent_sessions_real.py).
CLAUDE_CONTEXT = 65536
CLAUDE_PRESET = PresetInfo("coder", (), CLAUDE_CONTEXT, 32768)
CODEX_PRESET = PresetInfo("coder", (), CONTEXT, 32768)
TOOL_ROUNDS = 3


@pytest.fixture(scope="module", autouse=True)
def agents() -> None:
    try:
        require_agents()
    except AgentsMissing as exc:
        pytest.fail(f"{exc}", pytrace=False)


class Scripted:
    """A fake upstream on 127.0.0.1: records every request and answers it with `answer(self, n,
    record)`, n counting the agent's model requests (not catalogue reads)."""

    def __init__(self, answer: Callable[[Scripted, int, dict[str, Any]], Response]) -> None:
        self.answer = answer
        self.records: list[dict[str, Any]] = []
        self.model_requests: list[dict[str, Any]] = []
        self.catalogue: dict[str, Any] | None = None
        app = Starlette(routes=[Route("/{path:path}", self._endpoint, methods=["GET", "POST", "HEAD"])])
        self.server = ThreadServer(app)

    async def _endpoint(self, request: Request) -> Response:
        raw = await request.body()
        record = {
            "method": request.method,
            "path": request.url.path,
            "query": dict(request.query_params),
            "headers": dict(request.headers),
            "body": json.loads(raw) if raw else None,
        }
        self.records.append(record)
        if request.method == "GET" and request.url.path.endswith("/models"):
            if self.catalogue is None:
                return JSONResponse({"error": {"message": "no catalogue"}}, status_code=404)
            return JSONResponse(self.catalogue)
        if request.method != "POST":
            return Response(status_code=200)
        self.model_requests.append(record)
        return self.answer(self, len(self.model_requests) - 1, record)

    def __enter__(self) -> Scripted:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    @property
    def url(self) -> str:
        return self.server.url


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _stream(events: list[bytes]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    return StreamingResponse(body(), media_type="text/event-stream")


# --- Claude Code (Anthropic Messages) --------------------------------------------------------


def _message(
    model: str, blocks: list[dict[str, Any]], stop_reason: str, input_tokens: int
) -> StreamingResponse:
    events = [
        _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": f"msg_{uuid.uuid4().hex[:16]}",
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "usage": {"input_tokens": input_tokens, "output_tokens": 1},
                },
            },
        )
    ]
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            _sse(
                "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
            ),
            _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}),
            _sse("content_block_stop", {"type": "content_block_stop", "index": index}),
        ]
    events += [
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason},
                "usage": {"input_tokens": input_tokens, "output_tokens": 5},
            },
        ),
        _sse("message_stop", {"type": "message_stop"}),
    ]
    return _stream(events)


def _asks_for_a_summary(body: dict[str, Any]) -> bool:
    # Claude Code's compaction request is the conversation plus one more user text block that
    # asks for a summary; a normal turn after a tool ends on the tool_result.
    last = body["messages"][-1]
    blocks = (
        last["content"] if isinstance(last["content"], list) else [{"type": "text", "text": last["content"]}]
    )
    texts = [b.get("text", "") for b in blocks if b.get("type") == "text"]
    return last["role"] == "user" and any("summary" in t.lower() for t in texts)


def claude_script(last_prompt_tokens: int) -> Callable[[Scripted, int, dict[str, Any]], Response]:
    """Bash `echo` for TOOL_ROUNDS turns, the last reporting `last_prompt_tokens` of prompt."""

    def answer(server: Scripted, n: int, record: dict[str, Any]) -> Response:
        body = record["body"]
        if _asks_for_a_summary(body):
            return _message(
                body["model"], [{"type": "text", "text": "<summary>work so far</summary>"}], "end_turn", 3000
            )
        rounds = sum(1 for r in server.model_requests[:-1] if not _asks_for_a_summary(r["body"]))
        if rounds < TOOL_ROUNDS:
            tool = {
                "type": "tool_use",
                "id": f"toolu_{rounds}",
                "name": "Bash",
                "input": {"command": "echo fleet-ok"},
            }
            tokens = last_prompt_tokens if rounds == TOOL_ROUNDS - 1 else 3000
            return _message(body["model"], [{"type": "text", "text": "running"}, tool], "tool_use", tokens)
        return _message(body["model"], [{"type": "text", "text": "done"}], "end_turn", 3000)

    return answer


def printed_claude_environment(url: str) -> dict[str, str]:
    env = {}
    for line in render("claude", url, [CLAUDE_PRESET]).splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value
    # The key is the test's dummy one (claude_env sets it).
    env.pop("ANTHROPIC_AUTH_TOKEN")
    return env


def run_claude_against(last_prompt_tokens: int, home: AgentHome) -> Scripted:
    with Scripted(claude_script(last_prompt_tokens)) as server:
        env = printed_claude_environment(server.url)
        assert env["ANTHROPIC_BASE_URL"] == server.url
        run = run_claude(
            server.url,
            "run echo fleet-ok with Bash three times, then say done",
            home,
            allowed_tools=("Bash",),
            extra=env,
            timeout=120,
        )
        assert run.returncode == 0, run.describe()
    return server


def test_claude_code_compacts_at_the_window_connect_prints(tmp_path: Path) -> None:
    threshold = claude_compact_threshold(CLAUDE_CONTEXT, output_budget(CLAUDE_PRESET))
    with AgentHome(tmp_path) as home:
        server = run_claude_against(threshold + 1500, home)
    bodies = [r["body"] for r in server.model_requests]
    assert all(b["model"] == "coder" for b in bodies)
    assert all(b["max_tokens"] == output_budget(CLAUDE_PRESET) for b in bodies)
    summaries = [i for i, b in enumerate(bodies) if _asks_for_a_summary(b)]
    assert summaries, [len(b["messages"]) for b in bodies]
    # The turn after the summary carries a shorter conversation than the one that was summarised.
    after = bodies[summaries[-1] + 1]
    assert len(after["messages"]) < len(bodies[summaries[0]]["messages"])


def test_claude_code_does_not_compact_below_the_window_connect_prints(tmp_path: Path) -> None:
    threshold = claude_compact_threshold(CLAUDE_CONTEXT, output_budget(CLAUDE_PRESET))
    with AgentHome(tmp_path) as home:
        server = run_claude_against(threshold - 4000, home)
    bodies = [r["body"] for r in server.model_requests]
    assert not [b for b in bodies if _asks_for_a_summary(b)]
    assert len(bodies) == TOOL_ROUNDS + 1


def test_claude_code_without_the_printed_window_does_not_compact(tmp_path: Path) -> None:
    # The control: the same prompt size with the preset's name but no window variable.
    threshold = claude_compact_threshold(CLAUDE_CONTEXT, output_budget(CLAUDE_PRESET))
    with Scripted(claude_script(threshold + 1500)) as server, AgentHome(tmp_path) as home:
        env = printed_claude_environment(server.url)
        del env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"]
        run = run_claude(
            server.url,
            "run echo fleet-ok with Bash three times, then say done",
            home,
            allowed_tools=("Bash",),
            extra=env,
            timeout=120,
        )
        assert run.returncode == 0, run.describe()
    assert not [r for r in server.model_requests if _asks_for_a_summary(r["body"])]


# --- Codex (OpenAI Responses) -------------------------------------------------------------------


def _usage(total: int) -> dict[str, Any]:
    return {
        "input_tokens": total - 10,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 10,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": total,
    }


def _response(items: list[dict[str, Any]], total: int) -> StreamingResponse:
    rid = f"resp_{uuid.uuid4().hex[:16]}"
    events = [
        _sse(
            "response.created", {"type": "response.created", "response": {"id": rid, "status": "in_progress"}}
        )
    ]
    for index, item in enumerate(items):
        events.append(
            _sse(
                "response.output_item.done",
                {"type": "response.output_item.done", "output_index": index, "item": item},
            )
        )
    events.append(
        _sse(
            "response.completed",
            {
                "type": "response.completed",
                "response": {"id": rid, "status": "completed", "output": items, "usage": _usage(total)},
            },
        )
    )
    return _stream(events)


def _codex_summary_request(body: dict[str, Any]) -> bool:
    # Codex's compaction request ends with a user message asking for a handoff summary.
    last = body["input"][-1]
    return (
        last.get("type") == "message" and last.get("role") == "user" and "summary" in json.dumps(last).lower()
    )


def codex_script(last_total_tokens: int) -> Callable[[Scripted, int, dict[str, Any]], Response]:
    """`exec_command echo` for two turns, the second reporting `last_total_tokens` in all."""

    def answer(server: Scripted, n: int, record: dict[str, Any]) -> Response:
        body = record["body"]
        if _codex_summary_request(body):
            return _response([_text("work so far")], 500)
        if n < 2:
            call = {
                "type": "function_call",
                "id": f"fc_{n}",
                "call_id": f"call_{n}",
                "name": "exec_command",
                "arguments": json.dumps({"cmd": "echo fleet-ok"}),
                "status": "completed",
            }
            return _response([call], last_total_tokens if n == 1 else 1000)
        return _response([_text("done")], 1200)

    return answer


def _text(text: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex[:12]}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def run_codex_with(config: str, home: AgentHome) -> Any:
    home.codex_home.mkdir(parents=True, exist_ok=True)
    (home.codex_home / "config.toml").write_text(config)
    command = [
        str(codex_binary()),
        "exec",
        "--skip-git-repo-check",
        "--sandbox",
        "workspace-write",
        "--json",
        "run echo fleet-ok twice, then say done",
    ]
    return run_turn(command, codex_env(home, env_key="FLEET_GATEWAY_KEY"), home.project, timeout=120)


def printed_codex_config(url: str) -> str:
    return render("codex", url, [CODEX_PRESET])


@pytest.mark.parametrize("above", [True, False], ids=["above-the-limit", "below-the-limit"])
def test_codex_compacts_at_the_limit_connect_prints(above: bool, tmp_path: Path) -> None:
    limit = codex_compact_limit(CONTEXT)
    with (
        Scripted(codex_script(limit + 500 if above else limit - 1500)) as server,
        AgentHome(tmp_path) as home,
    ):
        config = printed_codex_config(server.url)
        assert tomllib.loads(config)["model_auto_compact_token_limit"] == limit
        run = run_codex_with(config, home)
        assert run.returncode == 0, run.describe()
    bodies = [r["body"] for r in server.model_requests]
    summaries = [i for i, b in enumerate(bodies) if _codex_summary_request(b)]
    if not above:
        assert not summaries and len(bodies) == 3
        return
    assert summaries, [len(b["input"]) for b in bodies]
    after = bodies[summaries[0] + 1]
    assert len(after["input"]) < len(bodies[summaries[0]]["input"])


# Codex asks for its catalogue only for a provider that authenticates with a command.
CATALOGUE_CONFIG = """model = "coder"
model_provider = "fleet"

[model_providers.fleet]
name = "fleet"
base_url = "{url}/v1"
wire_api = "responses"

[model_providers.fleet.auth]
command = "printf"
args = ["dummy-key"]
"""
CARDS = [
    {"id": "dense", "object": "model", "aliases": ["coder"], "vision": False, "context_length": CONTEXT},
    {"id": "coder", "object": "model", "preset": "dense"},
]


def test_codex_reads_the_gateway_shaped_catalogue_and_compacts_at_its_limit(tmp_path: Path) -> None:
    limit = codex_compact_limit(CONTEXT)
    with Scripted(codex_script(limit + 500)) as server, AgentHome(tmp_path) as home:
        server.catalogue = catalogue.listing(CARDS, "codex", "You are a coding agent; use the tools given.")
        run = run_codex_with(CATALOGUE_CONFIG.replace("{url}", server.url), home)
        assert run.returncode == 0, run.describe()
        reads = [r["query"] for r in server.records if r["method"] == "GET"]
    assert reads and all(catalogue.shape(q, {}) == "codex" for q in reads)
    # Parsed: no fallback-metadata warning, and compaction at the catalogue's limit, where
    # Codex's fallback window (272k) would not have compacted.
    assert "Model metadata for `coder` not found" not in run.stdout
    assert any(_codex_summary_request(r["body"]) for r in server.model_requests)


def test_codex_carries_on_when_the_catalogue_does_not_parse(tmp_path: Path) -> None:
    with Scripted(codex_script(1000)) as server, AgentHome(tmp_path) as home:
        # No base prompt configured: the gateway answers the OpenAI list, which Codex cannot decode.
        server.catalogue = catalogue.listing(CARDS, "codex")
        run = run_codex_with(CATALOGUE_CONFIG.replace("{url}", server.url), home)
    assert run.returncode == 0, run.describe()
    assert [r for r in server.records if r["method"] == "GET"]
    assert "Model metadata for `coder` not found" in run.stdout
    assert '"text":"done"' in run.stdout
