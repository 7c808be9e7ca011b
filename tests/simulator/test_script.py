"""The simulator's scripted compaction (`SimConfig.summaries`): the agents' own compaction requests,
as captured, are answered with a summary; a step left undone is restated in it; nothing changes
with the knob off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.simulator import messages, script
from gateway.simulator.engine import Prepared, SimConfig
from gateway.simulator.responses import Store

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"


def captured(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((FIXTURES / name).read_text())["body"]
    return body


def prepared(name: str, summaries: bool) -> Prepared:
    body = captured(name)
    config = SimConfig(
        engine="vllm", model=body["model"], time_scale=0, context=1_000_000, summaries=summaries
    )
    raw = orjson.dumps(body)
    if "messages" in body:
        return messages.prepare(config, raw, "application/json")
    return Store(config).prepare(config, raw, "application/json")


@pytest.mark.parametrize("fixture", ["claude-code-messages-compact.json", "codex-responses-compact.json"])
def test_an_agents_compaction_request_is_answered_with_a_summary(fixture: str) -> None:
    plan = prepared(fixture, summaries=True).script
    assert plan is not None and plan.echo is not None and plan.echo.startswith(script.SUMMARY)
    assert plan.echo.endswith("</summary>")


@pytest.mark.parametrize("fixture", ["claude-code-messages-compact.json", "codex-responses-compact.json"])
def test_without_the_knob_a_compaction_request_gets_no_summary(fixture: str) -> None:
    plan = prepared(fixture, summaries=False).script
    assert plan is None or not (plan.echo or "").startswith(script.SUMMARY)


@pytest.mark.parametrize("fixture", ["claude-code-messages.json", "codex-responses.json"])
def test_an_ordinary_agent_turn_asks_for_no_summary(fixture: str) -> None:
    plan = prepared(fixture, summaries=True).script
    assert plan is None or not (plan.echo or "").startswith(script.SUMMARY)


ASK = {"role": "user", "content": "Reply with an <analysis> block followed by a <summary> block."}
CALL = {"role": "user", "content": 'Turn 2: run this [[tool Bash {"command": "seq 1 9"}]]'}
TOOL_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}],
}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "1\n2"}


def test_a_summary_taken_in_the_middle_of_a_tool_round_restates_the_call_left_to_make() -> None:
    plan = script.summary([CALL, TOOL_CALL, RESULT, ASK])
    assert plan is not None and plan.echo is not None
    # Resuming from the summary alone, the agent's next request asks for the same call again.
    assert script.find_marker(plan.echo) == ("Bash", '{"command": "seq 1 9"}')


def test_a_summary_after_the_tool_result_was_echoed_restates_nothing() -> None:
    echoed = {"role": "assistant", "content": script.ECHO + "1 2"}
    plan = script.summary([CALL, TOOL_CALL, RESULT, echoed, ASK])
    assert plan is not None and plan.echo is not None and script.MARKER not in plan.echo


def test_an_ask_answered_earlier_in_the_history_is_no_new_ask() -> None:
    summary = {"role": "assistant", "content": "<summary>done</summary>"}
    assert script.summary([ASK, summary, {"role": "user", "content": "go on"}]) is None
