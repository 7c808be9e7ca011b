"""Codex's custom tools and namespaces on engines that know only function tools: the request as
captured from Codex 0.171 (its default model's lighter form), its history, and the answers' calls
turned back into what Codex declared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

from gateway.answers.changes import Changes
from gateway.answers.codex_calls import CodexCalls, ToolNames
from gateway.answers.events import Event, parse
from gateway.pipeline.rewrite import rewrite
from gateway.routing.table import parse_table

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
PRESET = parse_table(
    "presets: {m: {served_model: m, replicas: [{name: r, url: 'http://r.test:1', engine: llamacpp}]}}\n"
    "routing: {default: m}\n"
).presets["m"]


def captured(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())["body"]  # type: ignore[no-any-return]


def tools_by_name(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in body["tools"]}


def test_the_lite_forms_custom_exec_tool_goes_up_as_a_function_with_one_string_input() -> None:
    plan = rewrite(captured("codex-responses-lite.json"), PRESET, "responses", want_usage=True)
    tools = tools_by_name(plan.body)
    assert all(t["type"] == "function" for t in plan.body["tools"])
    execute = tools["exec"]
    assert execute["parameters"]["properties"] == {
        "input": {"type": "string", "description": "The tool's raw input text"}
    }
    assert (
        "raw input text" in execute["description"] and "PRAGMA_LINE" in execute["description"]
    )  # its grammar
    assert {"wait", "clock__sleep", "collaboration__spawn_agent"} <= set(tools)
    assert not any(i.get("type") == "additional_tools" for i in plan.body["input"])
    assert ("codex_tools", "custom_tools=1,namespaced=7") in plan.notes
    assert any(isinstance(c, CodexCalls) for c in plan.changes.items)


def test_the_history_of_custom_and_namespaced_calls_goes_up_as_the_engine_would_have_made_it() -> None:
    body = captured("codex-responses-lite-custom-tool-output.json")
    plan = rewrite(body, PRESET, "responses", want_usage=True)
    call, output = plan.body["input"][-2:]
    assert call["type"] == "function_call" and call["name"] == "exec" and call["call_id"] == "call_c1"
    assert json.loads(call["arguments"])["input"].startswith("const r = await tools.exec_command")
    assert output["type"] == "function_call_output" and output["call_id"] == "call_c1"
    assert output["output"].startswith("Script completed\nWall time") and '"exit_code":0' in output["output"]
    assert body["input"][-2]["type"] == "custom_tool_call"  # the client's body is left as it came
    body = captured("codex-responses-lite-namespace-call-output.json")
    call = rewrite(body, PRESET, "responses", want_usage=True).body["input"][-2]
    assert call["name"] == "clock__sleep" and "namespace" not in call


def test_a_request_without_custom_tools_or_namespaces_keeps_its_bytes() -> None:
    body = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}
    plan = rewrite(body, PRESET, "responses", want_usage=True)
    assert plan.body["tools"] is body["tools"]
    assert not any(isinstance(c, CodexCalls) for c in plan.changes.items)


NAMES = ToolNames(custom={"exec"}, namespaced={"clock__sleep": ("clock", "sleep")})


def test_a_whole_answers_calls_come_back_as_declared() -> None:
    payload = {
        "output": [
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "c1",
                "name": "exec",
                "arguments": '{"input": "text(1)"}',
            },
            {
                "type": "function_call",
                "id": "fc_2",
                "call_id": "c2",
                "name": "clock__sleep",
                "arguments": "{}",
            },
            {"type": "message", "content": []},
        ]
    }
    out = CodexCalls(NAMES).whole(payload)["output"]
    assert out[0] == {
        "type": "custom_tool_call",
        "id": "fc_1",
        "call_id": "c1",
        "name": "exec",
        "input": "text(1)",
    }
    assert out[1]["name"] == "sleep" and out[1]["namespace"] == "clock" and out[1]["type"] == "function_call"
    assert out[2] == {"type": "message", "content": []}


def event(data: dict[str, Any]) -> Event:
    return parse(b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")[0]


def test_a_streamed_custom_call_becomes_custom_tool_call_input_events() -> None:
    added = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "exec", "arguments": ""}
    done = {**added, "arguments": '{"input": "text(1)"}', "status": "completed"}
    stream = [
        {"type": "response.output_item.added", "output_index": 0, "item": added},
        {
            "type": "response.function_call_arguments.delta",
            "item_id": "fc_1",
            "output_index": 0,
            "delta": '{"input": ',
        },
        {
            "type": "response.function_call_arguments.delta",
            "item_id": "fc_1",
            "output_index": 0,
            "delta": '"text(1)"}',
        },
        {
            "type": "response.function_call_arguments.done",
            "item_id": "fc_1",
            "output_index": 0,
            "arguments": done["arguments"],
        },
        {"type": "response.output_item.done", "output_index": 0, "item": done},
        {"type": "response.completed", "response": {"id": "r", "output": [done]}},
    ]
    changes = Changes([CodexCalls(NAMES)])
    out = [e.data for e in changes.stream([event(d) for d in stream])]
    assert [d["type"] for d in out if d] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert out[0]["item"]["type"] == "custom_tool_call"
    assert out[1]["delta"] == "text(1)" and out[2]["input"] == "text(1)"
    assert out[3]["item"] == {
        "type": "custom_tool_call",
        "id": "fc_1",
        "call_id": "c1",
        "status": "completed",
        "name": "exec",
        "input": "text(1)",
    }
    assert out[4]["response"]["output"][0]["type"] == "custom_tool_call"


def test_events_that_need_no_change_keep_their_bytes() -> None:
    raw = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    out = Changes([CodexCalls(NAMES)]).stream(parse(raw))
    assert b"".join(e.encode() for e in out) == raw


def test_replayed_reasoning_keeps_only_what_a_model_can_read() -> None:
    body = {
        "model": "m",
        "input": [
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": None, "encrypted_content": None},
            {
                "type": "reasoning",
                "id": "rs_2",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
                "encrypted_content": "gAAA",
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        ],
    }
    plan = rewrite(body, PRESET, "responses", want_usage=True)
    assert [i.get("id") for i in plan.body["input"] if i["type"] == "reasoning"] == ["rs_2"]
    assert "encrypted_content" not in plan.body["input"][1]
    assert ("reasoning_replay", "reasoning_dropped=1,encrypted_removed=1") in plan.notes
    assert len(body["input"]) == 4  # the client's body is left as it came
