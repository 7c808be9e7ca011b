"""Tool calls with the real agents and engines through the gateway.

The real Claude Code and Codex CLIs complete their tool loops against a simulator that leaks its
calls as text or breaks their ids (the gateway repairs the answer, the agent runs the tool, and the
next turn carries the result back); and the real llama-server and vLLM accept, through the gateway,
the histories they refuse when sent directly: one that ends with unanswered calls, calls without
ids, and (with the `tool_pairing` fix) unpaired calls under a template that insists on pairs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from bench.support.agents import AgentHome, AgentsMissing, require_agents, run_claude, run_codex
from gateway.simulator import SimConfig, create_app
from tests.support.harness import Running, eventually, run_gateway
from tests.support.servers import ThreadServer

from .backends import LlamaServer, VllmServer

DEFAULT_FIXES = (
    "billing_header, system_in_turns, anthropic_only_fields, codex_lite, codex_tools, reasoning_replay, "
    "unknown_tool_types"
)
# ChatML that insists every tool call has its result and every result its call, the way Mistral-style
# templates do (the Qwen3 templates render calls and results by position and check neither).
STRICT_PAIRS = """\
{%- set ns = namespace(pending='') -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
{%- set key = '|' + (message.tool_call_id or '') + '|' -%}
{%- if key not in ns.pending -%}{{ raise_exception('A tool result without its call') }}{%- endif -%}
{%- set ns.pending = ns.pending | replace(key, '') -%}
{%- else -%}
{%- if ns.pending -%}{{ raise_exception('A tool call without its result') }}{%- endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for call in message.tool_calls -%}{%- set ns.pending = ns.pending + '|' + (call.id or '') + '|' -%}{%- endfor -%}
{%- endif -%}
{%- endif -%}
{{- '<|im_start|>' + message.role + '\\n' + (message.content if message.content is string else '') + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if ns.pending -%}{{ raise_exception('A tool call without its result') }}{%- endif -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

BASH = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "Bash", "parameters": BASH}}]
MESSAGES_TOOLS = [{"name": "Bash", "input_schema": BASH}]
RESPONSES_TOOLS = [{"type": "function", "name": "Bash", "parameters": BASH}]
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def table(url: str, engine: str, compat: str = DEFAULT_FIXES, served: str = "tiny") -> str:
    return f"""
defaults: {{max_tokens: 64, min_max_tokens: 0, params: {{temperature: 0}}, compat: [{compat}]}}
presets:
  coder:
    served_model: {served}
    aliases: ["claude-*", "gpt-*"]
    replicas: [{{name: r0, url: "{url}", engine: {engine}}}]
routing: {{default: coder}}
"""


def logged(gw: Running, endpoint: str) -> list[dict[str, Any]]:
    return [e for e in gw.log_entries() if e.get("endpoint") == endpoint]


# --- the agents against a misbehaving simulator -------------------------------------------------


@pytest.fixture(scope="module")
def agents() -> None:
    try:
        require_agents()
    except AgentsMissing as exc:
        pytest.fail(f"{exc}", pytrace=False)


@pytest.fixture
def leaky(agents: None) -> Iterator[ThreadServer]:
    server = ThreadServer(
        create_app(SimConfig(engine="llamacpp", model="tiny", time_scale=0, context=200_000))
    )
    yield server.start()
    server.stop()


def misbehave(server: ThreadServer, mode: str) -> None:
    assert httpx2.post(server.url + "/sim/config", json={"misbehave": mode}, timeout=10).status_code == 200


@pytest.mark.parametrize("mode", ["leak_xml", "dup_ids"])
def test_claude_codes_tool_loop_completes_on_a_model_that_leaks_its_calls(
    leaky: ThreadServer, tmp_path: Path, mode: str
) -> None:
    misbehave(leaky, mode)
    with (
        run_gateway(table(leaky.url, "llamacpp", DEFAULT_FIXES + ", tool_call_repair")) as gw,
        AgentHome(tmp_path) as home,
    ):
        run = run_claude(gw.url, 'Run this [[tool Bash {"command": "echo fleet-ok"}]]', home, timeout=240)
        assert run.returncode == 0, run.describe()
        result = run.json()["result"]
        assert "tool result: " in result and "fleet-ok" in result, run.describe()
        entries = eventually(lambda: len(logged(gw, "messages")) >= 2 and logged(gw, "messages"))
        assert {e["status"] for e in entries} == {200}


def test_without_the_repair_claude_code_takes_the_leaked_call_for_its_answer(
    leaky: ThreadServer, tmp_path: Path
) -> None:
    misbehave(leaky, "leak_xml")
    with run_gateway(table(leaky.url, "llamacpp")) as gw, AgentHome(tmp_path) as home:
        run = run_claude(gw.url, 'Run this [[tool Bash {"command": "echo fleet-ok"}]]', home, timeout=240)
        assert run.returncode == 0, run.describe()
        result = run.json()["result"]
        assert "<function=Bash>" in result and "tool result: " not in result, run.describe()


@pytest.mark.parametrize("mode", ["leak_hermes", "missing_ids"])
def test_codexs_tool_loop_completes_on_a_model_that_leaks_its_calls(
    leaky: ThreadServer, tmp_path: Path, mode: str
) -> None:
    misbehave(leaky, mode)
    with (
        run_gateway(table(leaky.url, "llamacpp", DEFAULT_FIXES + ", tool_call_repair")) as gw,
        AgentHome(tmp_path) as home,
    ):
        prompt = 'Run this [[tool exec_command {"cmd": "echo fleet-ok"}]]'
        run = run_codex(gw.url + "/v1", prompt, home, model="coder", timeout=240)
        assert run.returncode == 0, run.describe()
        assert "tool result: " in run.stdout and "fleet-ok" in run.stdout, run.describe()
        entries = eventually(lambda: len(logged(gw, "responses")) >= 2 and logged(gw, "responses"))
        assert {e["status"] for e in entries} == {200}


# --- histories the engines refuse ---------------------------------------------------------------

CALL = {"id": "call_a", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
UNANSWERED = {
    "chat": {
        "messages": [
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
        ],
        "tools": CHAT_TOOLS,
        "max_tokens": 4,
    },
    "messages": {
        "messages": [
            {"role": "user", "content": "list"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {"command": "ls"}}
                ],
            },
        ],
        "tools": MESSAGES_TOOLS,
        "max_tokens": 4,
    },
    "responses": {
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]},
            {"type": "function_call", "call_id": "call_a", "name": "Bash", "arguments": '{"command": "ls"}'},
        ],
        "tools": RESPONSES_TOOLS,
        "max_output_tokens": 16,
        "store": False,
    },
}
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def post(url: str, form: str, body: dict[str, Any]) -> httpx2.Response:
    return httpx2.post(url + PATHS[form], json={"model": "tiny", **body}, headers=ANTHROPIC, timeout=120)


@pytest.fixture(scope="module")
def llama(tiny_gguf: Path) -> Iterator[LlamaServer]:
    with LlamaServer(tiny_gguf, slots=1, ctx=8192, name="tool-history") as server:
        yield server


@pytest.mark.parametrize("form", sorted(UNANSWERED))
def test_llama_server_answers_a_history_that_ends_with_an_unanswered_call_through_the_gateway(
    llama: LlamaServer, form: str
) -> None:
    direct = post(llama.url, form, UNANSWERED[form])
    assert (
        direct.status_code == 400
        and "Cannot continue an assistant message that contains tool calls" in direct.text
    )
    with run_gateway(table(llama.url, "llamacpp")) as gw:
        answer = post(gw.url, form, UNANSWERED[form])
        assert answer.status_code == 200, answer.text
        assert "calls_answered=1" in answer.headers["x-gateway-rewrites"]


def test_llama_server_answers_responses_calls_without_call_ids_through_the_gateway(
    llama: LlamaServer,
) -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]},
        {"type": "function_call", "name": "Bash", "arguments": "{}"},
        {"type": "function_call_output", "output": "a b c"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go on"}]},
    ]
    body = {"input": items, "tools": RESPONSES_TOOLS, "max_output_tokens": 16, "store": False}
    direct = post(llama.url, "responses", body)
    assert direct.status_code == 400 and "Cannot determine type of 'item'" in direct.text
    with run_gateway(table(llama.url, "llamacpp")) as gw:
        answer = post(gw.url, "responses", body)
        assert answer.status_code == 200, answer.text
        assert "ids_minted=2" in answer.headers["x-gateway-rewrites"]


@pytest.mark.parametrize("paired", [True, False])
def test_a_template_that_insists_on_pairs_needs_the_tool_pairing_fix(
    tiny_gguf: Path, tmp_path: Path, paired: bool
) -> None:
    """An interrupted turn leaves a call without its result in the middle of the history (and a
    result whose call is gone); a template that insists on pairs refuses every later request
    unless the gateway pairs them."""
    template = tmp_path / "strict-pairs.jinja"
    template.write_text(STRICT_PAIRS)
    interrupted = {
        "messages": [
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_gone", "content": "?"},
            {"role": "user", "content": "never mind, go on"},
        ],
        "tools": CHAT_TOOLS,
        "max_tokens": 4,
    }
    compat = DEFAULT_FIXES + (", tool_pairing" if paired else "")
    strict = ("--chat-template-file", str(template))
    with LlamaServer(tiny_gguf, slots=1, ctx=8192, extra_args=strict, name="strict-pairs") as server:
        assert post(server.url, "chat", interrupted).status_code == 400
        with run_gateway(table(server.url, "llamacpp", compat)) as gw:
            answer = post(gw.url, "chat", interrupted)
    if paired:
        assert answer.status_code == 200, answer.text
        assert "calls_answered=1,results_dropped=1" in answer.headers["x-gateway-rewrites"]
    else:
        assert answer.status_code == 400 and "without its" in answer.json()["error"]["message"]


def test_vllm_answers_a_chat_call_without_an_id_through_the_gateway(vllm_replica: VllmServer) -> None:
    call = {"type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
    messages = [
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "a b c"},
        {"role": "user", "content": "go on"},
    ]
    body = {"messages": messages, "tools": CHAT_TOOLS, "max_tokens": 4}
    direct = post(vllm_replica.url, "chat", body)
    assert direct.status_code == 400 and "Field required" in direct.text
    with run_gateway(table(vllm_replica.url, "vllm")) as gw:
        answer = post(gw.url, "chat", body)
        assert answer.status_code == 200, answer.text
        assert "ids_minted=1" in answer.headers["x-gateway-rewrites"]
        assert json.loads(answer.text)["choices"]
