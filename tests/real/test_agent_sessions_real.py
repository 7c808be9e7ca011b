"""Real Claude Code and Codex sessions through the gateway, where a session meets a local fleet's
limits: a context that fills up, Codex's lighter request form with its default model name, a full
queue, and a prefill that outlasts the agent's own timeouts.

The CLIs from `.agents/` (claude-code 2.1.332, codex 0.171.0) run headless with a scratch HOME and
a dummy key against the in-thread gateway, in front of the scripted simulator: a
`[[tool NAME {json}]]` marker in the prompt makes the replica call that tool, a tool's result comes
back as "tool result: ...", and with `summaries` on an agent's compaction request gets a
`<summary>` (gateway/simulator/script.py). What each test showed is in docs/agents.md ("Agent
sessions that last").
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from bench.support.agents import AgentHome, AgentRun, AgentsMissing, require_agents, run_claude, run_codex
from gateway.simulator import SimConfig, create_app
from gateway.simulator.app import Replica
from gateway.simulator.script import SUMMARY_CUES
from tests.support.harness import Running, eventually, run_gateway
from tests.support.servers import ThreadServer

ALIAS = "local-coder"  # a name neither agent knows: each assumes its own default window for it
CONTINUED = "This session is being continued from a previous conversation"  # Claude Code, after compacting


@pytest.fixture(scope="module", autouse=True)
def agents() -> None:
    try:
        require_agents()
    except AgentsMissing as exc:
        pytest.fail(f"{exc}", pytrace=False)


@contextlib.contextmanager
def replica(**knobs: Any) -> Iterator[tuple[ThreadServer, Replica]]:
    """One simulated llama-server (it sends no headers before its first token), instant unless
    `time_scale` says otherwise."""
    config = SimConfig(
        **{"engine": "llamacpp", "model": "tiny", "time_scale": 0, "context": 200_000, **knobs}
    )
    app = create_app(config)
    server = ThreadServer(app).start()
    try:
        yield server, app.state.replica
    finally:
        server.stop()


def fleet_table(url: str, limits: str = "") -> str:
    # The agents' default names reach the same preset, as in the shipped routes.yaml.
    return f"""
defaults: {{max_tokens: 4096, min_max_tokens: 0, params: {{temperature: 0}}}}
presets:
  coder:
    served_model: tiny
    aliases: ["{ALIAS}", "claude-*", "gpt-*"]
    {limits}
    replicas: [{{name: r0, url: "{url}", engine: llamacpp}}]
routing: {{default: coder}}
"""


def entries(gw: Running, endpoint: str) -> list[dict[str, Any]]:
    return [e for e in gw.log_entries() if e.get("endpoint") == endpoint]


def asks_for_a_summary(entry: dict[str, Any]) -> bool:
    """The logged request ends with the agent's own request for a summary (it compacts)."""
    prompt = entry.get("prompt")
    last = json.dumps(prompt[-1]) if isinstance(prompt, list) and prompt else ""
    return any(cue in last for cue in SUMMARY_CUES)


def opens_with_a_summary(entry: dict[str, Any]) -> bool:
    prompt = entry.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and CONTINUED in json.dumps(prompt[0])


def replica_bodies(rep: Replica) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in rep.bodies]


# --- a context that fills up ---------------------------------------------------------------------

CONTEXT = 18_000  # Claude Code's first request is about 12,200 of the simulator's tokens
LINES = 1200  # one turn's command output: about 2,200 tokens


def turn_prompt(turn: int) -> str:
    command = f"seq {turn * 100_000} {turn * 100_000 + LINES}"
    return f"Turn {turn}: run this [[tool Bash {json.dumps({'command': command})}]]"


@pytest.mark.parametrize("model", [None, ALIAS], ids=["its-default-model", "an-alias"])
def test_claude_code_compacts_after_the_gateways_overflow_answer_and_completes_the_turn(
    model: str | None, tmp_path: Path
) -> None:
    """A session continued turn after turn (`claude -p --continue`) with Claude Code's own default
    model name or an alias: either way it assumes a window far past the replica's, and only the
    gateway's `prompt is too long` can tell it the context is full."""
    with (
        replica(context=CONTEXT, summaries=True) as (sim, _),
        run_gateway(fleet_table(sim.url), log_prompts=True) as gw,
        AgentHome(tmp_path) as home,
    ):
        results: list[str] = []
        for turn in range(4):
            run = run_claude(
                gw.url,
                turn_prompt(turn),
                home,
                model=model,
                allowed_tools=("Bash",),
                args=("--continue",) if turn else (),
                timeout=180,
            )
            assert run.returncode == 0 and run.json()["is_error"] is False, run.describe()
            results.append(run.json()["result"])
            if any(asks_for_a_summary(e) for e in entries(gw, "messages")):
                break
        log = eventually(lambda: entries(gw, "messages"))
    # Its own name reached the preset through the table's `claude-*` pattern, the alias by name.
    assert {e["route"] for e in log} == {"pattern" if model is None else "alias"}
    refused = [i for i, e in enumerate(log) if e["status"] == 400]
    assert refused, [(e["status"], e["estimated_tokens"]) for e in log]
    first = refused[0]
    assert log[first]["error_code"] == "context_length_exceeded"
    assert all(e["status"] == 200 for e in log[:first])  # the session ran until the context was full
    # The compaction request arrived after the refusal, and one of them (older turns left out when
    # the whole history did not fit either) was answered by the replica.
    summaries = [i for i, e in enumerate(log) if asks_for_a_summary(e)]
    assert summaries and summaries[0] > first
    answered = [i for i in summaries if log[i]["status"] == 200 and log[i]["prompt_tokens"]]
    assert answered, [(log[i]["status"], log[i]["estimated_tokens"]) for i in summaries]
    # Then the turn went on from the summary and completed: its tool's output came back.
    after = [e for e in log[answered[0] + 1 :] if opens_with_a_summary(e)]
    assert after and after[-1]["status"] == 200
    compacted_turn = len(results) - 1
    assert results[-1].startswith("tool result: ") and str(compacted_turn * 100_000) in results[-1]
    assert compacted_turn >= 1  # it compacted a history, not a first exchange


# --- Codex's lighter request form -----------------------------------------------------------------

EXEC_SCRIPT = 'const r = await tools.exec_command({cmd: "echo fleet-ok"}); text(r.output);'


def test_codex_with_its_default_model_runs_a_command_through_exec_and_gets_the_output_back(
    tmp_path: Path,
) -> None:
    """`gpt-6.2-sol` makes Codex send its tools in an `additional_tools` item, the shell only
    reachable through the free-form `exec` JavaScript tool; the gateway offers `exec` to the engine
    as a function with one `input` string and gives its call back to Codex as a custom tool call."""
    prompt = f"Run this [[tool exec {json.dumps({'input': EXEC_SCRIPT})}]]"
    with (
        replica() as (sim, rep),
        run_gateway(fleet_table(sim.url)) as gw,
        AgentHome(tmp_path) as home,
    ):
        run = run_codex(gw.url + "/v1", prompt, home, model=None, json_events=True, timeout=180)
        assert run.returncode == 0, run.describe()
        log = eventually(lambda: len(entries(gw, "responses")) >= 2 and entries(gw, "responses"))
        bodies = [b for b in replica_bodies(rep) if "input" in b]
    assert [e["status"] for e in log] == [200, 200]
    assert all("custom_tools=1" in ",".join(e["rewrites"]) for e in log)
    first, second = bodies
    # The engine was offered `exec` as a function of one string (Codex sent it as a custom tool).
    offered = [t for t in first["tools"] if t.get("name") == "exec"]
    assert [(t["type"], t["parameters"]["required"]) for t in offered] == [("function", ["input"])]
    # The second request carries the command's output, as a function call's output the engine reads.
    outputs = [i for i in second["input"] if i.get("type") == "function_call_output"]
    calls = [i for i in second["input"] if i.get("type") == "function_call"]
    assert calls and json.loads(calls[-1]["arguments"]) == {"input": EXEC_SCRIPT}
    assert outputs and "fleet-ok" in json.dumps(outputs[-1]["output"])
    # Codex ran the command inside its exec tool, and its final answer echoes the output.
    events = run.events()
    commands = [e["item"] for e in events if e.get("item", {}).get("type") == "command_execution"]
    assert any("echo fleet-ok" in c["command"] and c["exit_code"] == 0 for c in commands), run.describe()
    answers = [e["item"]["text"] for e in events if e.get("item", {}).get("type") == "agent_message"]
    assert answers and answers[-1].startswith("tool result: ") and "fleet-ok" in answers[-1]


# --- a full queue ---------------------------------------------------------------------------------


def wait_out_a_full_preset(
    tmp_path: Path, endpoint: str, agent: Callable[[str, AgentHome], AgentRun]
) -> tuple[AgentRun, list[dict[str, Any]], Replica]:
    """The preset's only place is held by another client's slow stream and its queue takes none; the
    agent runs one turn (`agent(gateway_url, home)`), and once the gateway has refused it on
    `endpoint` the holder's answer is let finish. The agent's run, the access log, the replica."""
    busy = "limits: {max_in_flight: 1, queue: 0}"
    # A token a second for a minute: the holder keeps its place until the test lets the replica run at
    # full speed (then the token in progress ends within a second, and the rest come at once).
    with (
        replica(time_scale=1, decode_tps=1, reasoning_tokens=0, answer_tokens=60) as (sim, rep),
        run_gateway(fleet_table(sim.url, busy)) as gw,
        AgentHome(tmp_path) as home,
    ):
        holder: dict[str, Any] = {}
        chat = {"model": ALIAS, "stream": True, "messages": [{"role": "user", "content": "hold the place"}]}

        def hold() -> None:
            holder["status"] = httpx2.post(
                gw.url + "/v1/chat/completions", json=chat, timeout=120
            ).status_code

        holding = threading.Thread(target=hold, daemon=True)
        holding.start()
        assert eventually(lambda: rep.in_flight == 1, timeout=10)
        ran: dict[str, AgentRun] = {}
        running = threading.Thread(target=lambda: ran.setdefault("run", agent(gw.url, home)), daemon=True)
        running.start()
        refused = eventually(
            lambda: [e for e in entries(gw, endpoint) if e.get("error_code") == "queue_full"], timeout=60
        )
        assert refused, gw.log_entries()
        # Drain: the holder's remaining tokens come at once.
        httpx2.post(sim.url + "/sim/config", json={"time_scale": 0}, timeout=10)
        holding.join(timeout=30)
        running.join(timeout=150)
        assert "run" in ran and holder.get("status") == 200
        # The holder's answer and the agent's retry, both recorded.
        log = eventually(
            lambda: sum(e["outcome"] == "completed" for e in gw.log_entries()) >= 2 and gw.log_entries()
        )
    return ran["run"], log, rep


def test_codex_waits_out_a_full_queue_and_retries_once_it_drains(tmp_path: Path) -> None:
    """Codex hears `response.failed` `rate_limit_exceeded` "Please try again in 1s.", waits, and its
    retry succeeds once the holder's answer has finished."""
    run, log, rep = wait_out_a_full_preset(
        tmp_path,
        "responses",
        # Codex's own retry settings: rate limits are retried under stream_max_retries.
        lambda url, home: run_codex(
            url + "/v1",
            "say ok",
            home,
            model=ALIAS,
            json_events=True,
            timeout=120,
            config={"max_retries": None},
        ),
    )
    assert run.returncode == 0, run.describe()
    order = [(e["endpoint"], e["outcome"], e.get("error_code")) for e in log]
    assert order[0] == ("responses", "rejected", "queue_full")
    assert order[-2:] == [("chat", "completed", None), ("responses", "completed", None)]
    waits = [
        e["message"] for e in run.events() if e.get("type") == "error" and "Reconnecting" in e["message"]
    ]
    assert waits and "rate limit exceeded" in waits[0] and "Please try again in 1s." in waits[0], (
        run.describe()
    )
    assert any(e.get("item", {}).get("type") == "agent_message" for e in run.events())
    assert rep.counters.requests == 2  # the holder's and Codex's retry: the refusal cost no GPU time


def test_claude_code_waits_out_a_full_queue_and_retries_once_it_drains(tmp_path: Path) -> None:
    """Claude Code hears a 429 `rate_limit_error` with `retry-after` and `x-should-retry: true`, which
    it retries on its own schedule until the holder's answer has finished; then its turn completes,
    and no refusal reached the replica."""
    run, log, rep = wait_out_a_full_preset(
        tmp_path,
        "messages",
        # Claude Code's own retry count (10 by default), not the runner's 0.
        lambda url, home: run_claude(url, "say ok", home, model=ALIAS, timeout=120, max_retries=None),
    )
    assert run.returncode == 0 and run.json()["is_error"] is False, run.describe()
    messages = [e for e in log if e["endpoint"] == "messages"]
    assert messages[0]["status"] == 429 and messages[0]["error_code"] == "queue_full"
    assert all(e["status"] == 429 for e in messages[:-1])  # retried while the place was held
    assert messages[-1]["status"] == 200 and messages[-1]["outcome"] == "completed"
    assert rep.counters.requests == 2  # the holder's and Claude Code's retry: refusals cost no GPU time


# --- a prefill longer than the agent's timeouts ---------------------------------------------------

# Open the stream after 1.5 s (the default), then an event every 2 s.
KEEPALIVE = {"keepalive_after": 1.5, "keepalive_every": 2.0}


def test_claude_code_keeps_a_stream_whose_first_token_comes_after_its_timeouts(tmp_path: Path) -> None:
    """Claude Code gives up on a request whose response headers take longer than `API_TIMEOUT_MS`,
    and on a stream silent for `CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS` (10 s, its minimum), then sends
    it again. Here the prefill takes about 17 s (12,200 tokens at 700 a second): the gateway opens
    the stream at 1.5 s and pings every 2 s, so the one request the replica got completes."""
    timeouts = {"CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "10000", "API_TIMEOUT_MS": "10000"}
    with (
        replica(time_scale=1, prefill_tps=700, decode_tps=1000, reasoning_tokens=0, answer_tokens=8) as (
            sim,
            rep,
        ),
        run_gateway(fleet_table(sim.url), **KEEPALIVE) as gw,
        AgentHome(tmp_path) as home,
    ):
        run = run_claude(gw.url, "say ok", home, model=ALIAS, timeout=120, extra=timeouts)
        assert run.returncode == 0 and run.json()["is_error"] is False, run.describe()
        log = eventually(lambda: entries(gw, "messages"))
    assert [(e["status"], e["outcome"]) for e in log] == [(200, "completed")]
    assert (rep.counters.requests, rep.counters.aborted) == (1, 0)  # no re-send, no abandoned prefill


def test_codex_keeps_a_stream_whose_first_token_comes_after_its_idle_timeout(tmp_path: Path) -> None:
    """Codex's `stream_idle_timeout_ms` (4 s here) counts from the response headers and is reset
    by events, not by SSE comments; the prefill takes about 10 s (9,900 tokens at 1,000 a second).
    With its own retry settings, a stream that went idle would have been sent again."""
    with (
        replica(time_scale=1, prefill_tps=1000, decode_tps=1000, reasoning_tokens=0, answer_tokens=8) as (
            sim,
            rep,
        ),
        run_gateway(fleet_table(sim.url), **KEEPALIVE) as gw,
        AgentHome(tmp_path) as home,
    ):
        config = {"max_retries": None, "stream_idle_timeout_ms": 4000}
        run = run_codex(
            gw.url + "/v1", "say ok", home, model=ALIAS, json_events=True, timeout=120, config=config
        )
        assert run.returncode == 0, run.describe()
        log = eventually(lambda: entries(gw, "responses"))
    assert [(e["status"], e["outcome"]) for e in log] == [(200, "completed")]
    assert not [e for e in run.events() if e.get("type") == "error"], run.describe()
    assert (rep.counters.requests, rep.counters.aborted) == (1, 0)
