"""The real coding agents, unchanged and with their default model names, through the gateway.

Claude Code (`claude -p`) and Codex (`codex exec`) from npm (`scripts/install-agents`), each with a
scratch HOME and a dummy key: one turn against a real llama-server, and one tool round trip (the
agent runs the tool and sends its result back) against the scripted simulator. The tiny model's
output is random bytes, so a turn on the real engine is judged by the agent's exit status and the
gateway's record, not by the text; temperature 0 keeps a Messages stream whole (docs/engines.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.agents import AgentHome, AgentsMissing, require_agents, run_claude, run_codex
from gateway.simulator import SimConfig, create_app
from tests.support.harness import Running, eventually, run_gateway
from tests.support.servers import ThreadServer

from .backends import LlamaServer

TEMPLATES = Path(__file__).resolve().parent / "templates"


@pytest.fixture(scope="module", autouse=True)
def agents() -> None:
    try:
        require_agents()
    except AgentsMissing as exc:
        pytest.fail(f"{exc}", pytrace=False)


# The tiny model's random weights rarely sample an end of turn, and Claude Code takes an answer
# cut by its budget for an error: any letter, digit or space ends this one (a real model stops on
# its own). llama-server reads `stop_sequences` on /v1/messages, not `logit_bias`.
STOP_EARLY = ', stop_sequences: [" ", "0", "1", "5", "9", a, e, f, i, o, u, s, t, y, n, r]'


def fleet_table(url: str, engine: str, extra: str = "", params: str = "") -> str:
    # The shipped routes.yaml maps the agents' names the same way.
    return f"""
defaults: {{max_tokens: 64, min_max_tokens: 0, params: {{temperature: 0{params}}}{extra}}}
presets:
  coder:
    served_model: tiny
    aliases: ["claude-*", "gpt-*"]
    replicas: [{{name: r0, url: "{url}", engine: {engine}}}]
routing: {{default: coder}}
"""


def messages_log(gw: Running, endpoint: str) -> list[dict[str, Any]]:
    return [e for e in gw.log_entries() if e.get("endpoint") == endpoint]


@pytest.fixture(scope="module")
def engine(tiny_gguf: Path) -> Iterator[LlamaServer]:
    # Claude Code's first request is about 45k tokens on the byte-level tiny vocabulary: one slot of 64k.
    with LlamaServer(tiny_gguf, slots=1, ctx=65536, name="agents") as server:
        yield server


@pytest.fixture(scope="module")
def scripted() -> Iterator[ThreadServer]:
    server = ThreadServer(
        create_app(SimConfig(engine="llamacpp", model="tiny", time_scale=0, context=200_000))
    )
    yield server.start()
    server.stop()


@pytest.mark.parametrize("policy", ["round_robin", "session"])
def test_claude_code_completes_a_turn_on_a_real_llama_server(
    engine: LlamaServer, tmp_path: Path, policy: str
) -> None:
    # Under `policy: session` its requests go to llama-server's chat endpoint, pinned to a slot,
    # and come back as Messages (gateway/dialects/messages_chat.py).
    with (
        run_gateway(fleet_table(engine.url, "llamacpp", f", policy: {policy}", params=STOP_EARLY)) as gw,
        AgentHome(tmp_path) as home,
    ):
        run = run_claude(gw.url, "say ok", home, timeout=240)
        assert run.returncode == 0, run.describe()
        result = run.json()
        assert result["is_error"] is False, run.describe()
        entries = eventually(lambda: messages_log(gw, "messages"))
        assert entries and {e["status"] for e in entries} == {200}, entries
        first = entries[0]
        assert first["preset"] == "coder" and first["route"] == "pattern"
        assert first["prompt_tokens"] > 5000  # the agent's whole system prompt and tools arrived
        rewrites = first["rewrites"]
        assert "billing_header=removed" in rewrites
        upstream = "chat-stream" if policy == "session" else "stream"
        assert {e["upstream"] for e in entries} == {upstream}, entries


@pytest.mark.parametrize("fixed", [True, False], ids=["billing_header_removed", "as_sent"])
def test_two_claude_code_sessions_share_the_whole_system_prompt_and_tools(
    engine: LlamaServer, tmp_path: Path, fixed: bool
) -> None:
    """The billing line at the very start differs per prompt; without its removal a second
    session reuses almost nothing of the first one's cache on llama-server (docs/agents.md)."""
    # Other fixes stay on: only the billing line's effect is compared.
    extra = "" if fixed else ", compat: [system_in_turns, anthropic_only_fields]"
    with run_gateway(fleet_table(engine.url, "llamacpp", extra, params=STOP_EARLY)) as gw:
        with AgentHome(tmp_path) as home:  # two sessions in one project, as a developer runs them
            for prompt in ("say ok", "what is two plus two"):
                run = run_claude(gw.url, prompt, home, timeout=240)
                assert run.returncode == 0, run.describe()
        entries = eventually(lambda: len(messages_log(gw, "messages")) >= 2 and messages_log(gw, "messages"))
        second = entries[-1]
        print(
            f"second session's first request: {second['cached_tokens']} of {second['prompt_tokens']} cached"
        )
        if fixed:
            # The system prompt and tools (most of the prompt) came from the first session's cache.
            assert second["cached_tokens"] >= 0.75 * second["prompt_tokens"], second
        else:
            assert second["cached_tokens"] < 0.1 * second["prompt_tokens"], second


def test_codex_completes_a_turn_on_a_real_llama_server(engine: LlamaServer, tmp_path: Path) -> None:
    with run_gateway(fleet_table(engine.url, "llamacpp")) as gw, AgentHome(tmp_path) as home:
        run = run_codex(gw.url + "/v1", "say ok", home, model="coder", timeout=240)
        assert run.returncode == 0, run.describe()
        entries = eventually(lambda: messages_log(gw, "responses"))
        assert entries and {e["status"] for e in entries} == {200}, entries
        assert entries[0]["preset"] == "coder"


def test_claude_code_tool_round_trip_against_the_simulator(scripted: ThreadServer, tmp_path: Path) -> None:
    with run_gateway(fleet_table(scripted.url, "llamacpp")) as gw, AgentHome(tmp_path) as home:
        prompt = 'Run this [[tool Bash {"command": "echo fleet-ok"}]]'
        run = run_claude(gw.url, prompt, home, timeout=180)
        assert run.returncode == 0, run.describe()
        assert "tool result: " in run.json()["result"] and "fleet-ok" in run.json()["result"], run.describe()
        entries = eventually(lambda: len(messages_log(gw, "messages")) >= 2 and messages_log(gw, "messages"))
        assert {e["status"] for e in entries} == {200}


def test_codex_tool_round_trip_against_the_simulator(scripted: ThreadServer, tmp_path: Path) -> None:
    with run_gateway(fleet_table(scripted.url, "llamacpp")) as gw, AgentHome(tmp_path) as home:
        prompt = 'Run this [[tool exec_command {"cmd": "echo fleet-ok"}]]'
        run = run_codex(gw.url + "/v1", prompt, home, model="coder", timeout=180)
        assert run.returncode == 0, run.describe()
        assert "tool result: " in run.stdout and "fleet-ok" in run.stdout, run.describe()
        entries = eventually(
            lambda: len(messages_log(gw, "responses")) >= 2 and messages_log(gw, "responses")
        )
        assert {e["status"] for e in entries} == {200}


@pytest.mark.parametrize("fixed", [True, False])
def test_a_strict_qwen3_style_template_needs_the_system_message_fix(tiny_gguf: Path, fixed: bool) -> None:
    """Claude Code puts a system-role message after the first user turn; a Qwen3-style template
    raises on it. With the gateway's fix the engine answers; without it, its 400 comes back."""
    fixture = json.loads(
        (Path(__file__).parents[1] / "fixtures" / "agents" / "claude-code-messages.json").read_text()
    )
    body = fixture["body"]
    assert any(m.get("role") == "system" for m in body["messages"][1:])
    extra = "" if fixed else ", compat: [billing_header]"
    strict = ("--chat-template-file", str(TEMPLATES / "strict-system.jinja"))
    with (
        LlamaServer(tiny_gguf, slots=1, ctx=65536, extra_args=strict, name="strict") as server,
        run_gateway(fleet_table(server.url, "llamacpp", extra)) as gw,
    ):
        import httpx2

        answer = httpx2.post(
            gw.url + "/v1/messages",
            json={**body, "stream": False, "max_tokens": 8},
            headers={"anthropic-version": "2023-06-01"},
            timeout=120,
        )
        if fixed:
            assert answer.status_code == 200, answer.text
            assert "system_in_turns=" in answer.headers["x-gateway-rewrites"]
        else:
            assert answer.status_code == 400, answer.text
            error = answer.json()
            assert (
                error["type"] == "error"
                and "System message must be at the beginning" in error["error"]["message"]
            )
