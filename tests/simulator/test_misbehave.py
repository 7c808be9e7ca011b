"""The simulator's tool-call misbehaviours: leaked calls in each model family's form, calls inside
the thinking, and parallel calls with repeated or missing ids, in every dialect of both engines;
off by default, set at start (SimConfig, the CLI) or at run time (/sim/config)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx2
import orjson
import pytest

from gateway.answers.leaked import Call, Tools, split
from gateway.simulator import SimConfig, create_app
from gateway.simulator.__main__ import build_parser
from gateway.simulator.misbehave import LEAKS, modes
from tests.support.servers import serve

BASH = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "Bash", "parameters": BASH}}]
PROMPT = 'Run it [[tool Bash {"command": "echo hi there"}]]'
CHAT = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "tools": CHAT_TOOLS}
MESSAGES = {
    "model": "m",
    "max_tokens": 500,
    "messages": CHAT["messages"],
    "tools": [{"name": "Bash", "input_schema": BASH}],
}
RESPONSES = {
    "model": "m",
    "input": PROMPT,
    "tools": [{"type": "function", "name": "Bash", "parameters": BASH}],
}
CALL = Call("Bash", '{"command":"echo hi there"}')


@contextmanager
def replica(engine: str = "vllm", **knobs: Any) -> Iterator[httpx2.Client]:
    config = SimConfig(engine, "m", time_scale=0, reasoning_tokens=3, **knobs)  # type: ignore[arg-type]
    with serve(create_app(config)) as server, httpx2.Client(base_url=server.url, timeout=10) as client:
        yield client


def events(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
@pytest.mark.parametrize("mode", [m for m in LEAKS if m != "think_call"])
def test_a_leaked_call_is_text_in_the_content_that_reads_back_as_the_call(engine: str, mode: str) -> None:
    with replica(engine, misbehave=mode) as client:
        choice = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
        assert split(choice["message"]["content"], Tools({"Bash": BASH})) == ("", [CALL])
        streamed = client.post("/v1/chat/completions", json={**CHAT, "stream": True}).text
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events(streamed) if e["choices"]
        )
        assert text == choice["message"]["content"]
        message = client.post("/v1/messages", json=MESSAGES).json()
        assert [b["type"] for b in message["content"]] == ["thinking", "text"] and message[
            "stop_reason"
        ] == "end_turn"
        output = client.post("/v1/responses", json=RESPONSES).json()["output"]
        assert [i["type"] for i in output] == ["reasoning", "message"]


def test_a_call_in_the_thinking_leaves_the_answer_empty() -> None:
    with replica("llamacpp", misbehave="think_call") as client:
        message = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        assert not message.get("content") and not message.get("tool_calls")
        assert split(message["reasoning_content"], Tools({"Bash": BASH}))[1] == [CALL]
        blocks = client.post("/v1/messages", json=MESSAGES).json()["content"]
        assert [b["type"] for b in blocks] == ["thinking"] and "<function=Bash>" in blocks[0]["thinking"]


@pytest.mark.parametrize("mode", ["dup_ids", "missing_ids"])
def test_parallel_calls_come_with_repeated_or_missing_ids_in_every_dialect(mode: str) -> None:
    with replica("vllm", misbehave=mode) as client:
        calls = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["tool_calls"]
        streamed = events(client.post("/v1/chat/completions", json={**CHAT, "stream": True}).text)
        deltas = [
            c for e in streamed if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls") or ()
        ]
        message = client.post("/v1/messages", json={**MESSAGES, "stream": True}).text
        starts = [e["content_block"] for e in events(message) if e["type"] == "content_block_start"]
        uses = [b for b in starts if b["type"] == "tool_use"]
        stream = events(client.post("/v1/responses", json={**RESPONSES, "stream": True}).text)
        done = [
            e["item"]
            for e in stream
            if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
        ]
        final = [i for i in stream[-1]["response"]["output"] if i["type"] == "function_call"]
    assert len(calls) == len(deltas) == len(uses) == len(done) == len(final) == 2
    assert [d["index"] for d in deltas] == [0, 1]
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    if mode == "dup_ids":
        assert (
            len({c["id"] for c in calls})
            == len({d["id"] for d in deltas})
            == len({b["id"] for b in uses})
            == 1
        )
        assert len({i["call_id"] for i in done}) == len({i["call_id"] for i in final}) == 1
    else:
        assert not any("id" in c for c in [*calls, *deltas, *uses])
        assert not any("call_id" in i for i in [*done, *final])


def test_no_mode_is_on_by_default_and_answers_are_as_they_were() -> None:
    with replica("vllm") as client:
        calls = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["Bash"]
        assert client.get("/sim/stats").json()["config"]["misbehave"] == ""


def test_modes_are_set_at_run_time_and_unknown_ones_refused() -> None:
    with replica("llamacpp") as client:
        assert (
            client.post("/sim/config", json={"misbehave": "leak_xml,dup_ids"}).json()["misbehave"]
            == "leak_xml,dup_ids"
        )
        content = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
        assert content.startswith("<tool_call>\n<function=Bash>")
        for bad in ("leak_everything", 3):
            answer = client.post("/sim/config", json={"misbehave": bad})
            assert answer.status_code == 400 and "error" in answer.json()
        assert client.post("/sim/config", json={"misbehave": ""}).json()["misbehave"] == ""


def test_modes_are_set_from_the_command_line_and_checked() -> None:
    args = vars(
        build_parser().parse_args(
            ["--engine", "vllm", "--port", "1", "--model", "m", "--misbehave", "leak_glm"]
        )
    )
    assert args["misbehave"] == "leak_glm"
    assert modes(" leak_xml , dup_ids ") == {"leak_xml", "dup_ids"}
    with pytest.raises(ValueError, match="unknown misbehave modes"):
        SimConfig("vllm", "m", misbehave="nope")
