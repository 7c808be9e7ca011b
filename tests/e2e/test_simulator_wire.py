"""The simulator's other wire formats over real sockets: Anthropic Messages (the ``anthropic`` package),
OpenAI Responses and embeddings (the ``openai`` package), tokenize, infill, rerank, and scripted tool loops."""

from __future__ import annotations

import base64
import contextlib
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx2
import openai
import orjson
import pytest

from gateway.simulator import SimConfig, create_app
from tests.support.servers import ThreadServer

ENGINES = ["vllm", "llamacpp"]
FAST = {"time_scale": 0.0, "reasoning_tokens": 6, "answer_tokens": 4}
KNOBS = {"time_scale", "decode_tps", "prefill_tps", "reasoning_tokens", "answer_tokens"}
LONG_SYSTEM = "You are a careful assistant. " * 40  # ~1100 bytes: several vLLM blocks
HI = [{"role": "user", "content": "hello"}]
BASH = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
BASH_FN = {"type": "function", "name": "Bash", "description": "Run a shell command"}
BASH_FN["parameters"] = BASH["input_schema"]
ASK_BASH = 'Please run it: [[tool Bash {"command": "echo hi"}]]'
OUTPUT = "hi\n" + "x" * 300  # longer than the 200 characters echoed back
_replicas: dict[tuple[Any, ...], ThreadServer] = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_replicas() -> Iterator[None]:
    yield
    for srv in _replicas.values():
        srv.stop()
    _replicas.clear()


@contextlib.contextmanager
def replica(engine: str, **fields: Any) -> Iterator[tuple[ThreadServer, httpx2.Client]]:
    """A replica with these settings, started once per module and reset (and its knobs set) for each use."""
    fixed = {k: v for k, v in fields.items() if k not in KNOBS}
    key = (engine, *sorted(fixed.items()))
    if key not in _replicas:
        cfg = SimConfig(engine, "qwen3", **{**FAST, **fixed})  # type: ignore[arg-type]
        _replicas[key] = ThreadServer(create_app(cfg)).start()
    srv = _replicas[key]
    knobs = {k: fields.get(k, FAST.get(k, getattr(SimConfig(engine, "q"), k))) for k in KNOBS}  # type: ignore[arg-type]
    with httpx2.Client(base_url=srv.url, timeout=10) as client:
        assert client.post("/sim/reset").status_code == 200
        assert client.post("/sim/config", json={**knobs, "fail": None}).status_code == 200
        yield srv, client


def claude(srv: ThreadServer, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0)


def gpt(srv: ThreadServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def stats(client: httpx2.Client) -> dict[str, Any]:
    result: dict[str, Any] = client.get("/sim/stats").json()
    return result


def named_events(text: str) -> list[tuple[str, Any]]:
    """(event name, data) of each `event: NAME\\ndata: JSON` SSE event."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[len("event: ") :], orjson.loads(data[len("data: ") :])))
    return out


def wait_for(probe: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# --- Anthropic Messages -------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_messages_create_with_system_blocks_and_cached_prefix(engine: str) -> None:
    with replica(engine) as (srv, _):
        client = claude(srv)
        ask: dict[str, Any] = {"model": "qwen3", "max_tokens": 200, "messages": HI}
        ask["system"] = [{"type": "text", "text": LONG_SYSTEM}]
        first = client.messages.create(**ask, thinking={"type": "disabled"})
        assert first.id.startswith("msg_")
        assert (first.type, first.role, first.model, first.stop_reason) == (
            "message",
            "assistant",
            "qwen3",
            "end_turn",
        )
        assert [b.type for b in first.content] == ["text"]
        assert len(first.content[0].text.split()) == 4
        assert first.usage.output_tokens == 4
        assert first.usage.cache_read_input_tokens == 0
        second = client.messages.create(**ask, thinking={"type": "disabled"})
        cached = second.usage.cache_read_input_tokens
        assert cached is not None and cached > 0
        assert second.usage.input_tokens == first.usage.input_tokens - cached  # input_tokens leaves it out
        assert (second.usage.cache_creation_input_tokens == 0) is (engine == "vllm")
        client.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_messages_thinking_block_trap_and_injected_kwargs(engine: str) -> None:
    with replica(engine, reasoning_tokens=300, answer_tokens=24) as (srv, _):
        client = claude(srv)
        ask: dict[str, Any] = {"model": "qwen3", "messages": HI, "thinking": {"type": "adaptive"}}
        fine = client.messages.create(**ask, max_tokens=1000)
        assert [b.type for b in fine.content] == ["thinking", "text"]
        assert len(fine.content[0].thinking.split()) == 300
        assert fine.content[0].signature == ""
        assert fine.usage.output_tokens == 324
        trap = client.messages.create(**ask, max_tokens=200)
        assert trap.stop_reason == "max_tokens"
        assert [b.type for b in trap.content] == ["thinking"]
        assert len(trap.content[0].thinking.split()) == 200
        # A gateway's injected chat_template_kwargs wins over the client's thinking switch.
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        saved = client.messages.create(**ask, max_tokens=200, extra_body=off)
        assert (saved.stop_reason, [b.type for b in saved.content]) == ("end_turn", ["text"])
        client.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_messages_stream_events(engine: str) -> None:
    with replica(engine) as (srv, c):
        body = {"model": "qwen3", "max_tokens": 100, "messages": HI, "stream": True}
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "[DONE]" not in r.text
        events = named_events(r.text)
        assert all(name == data["type"] for name, data in events)
        names = [name for name, _ in events]
        assert names[:3] == ["message_start", "content_block_start", "ping"]
        assert names[-2:] == ["message_delta", "message_stop"]
        assert names.count("content_block_start") == names.count("content_block_stop") == 2
        start = events[0][1]["message"]
        assert (start["content"], start["stop_reason"], start["usage"]["output_tokens"]) == ([], None, 0)
        assert start["usage"]["input_tokens"] > 0
        kinds = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
        assert kinds == ["thinking", "text"]
        deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
        assert [d["type"] for d in deltas] == ["thinking_delta"] * 6 + ["text_delta"] * 4
        final = events[-2][1]
        assert final["delta"]["stop_reason"] == "end_turn"
        assert final["usage"]["output_tokens"] == 10
        client = claude(srv)
        with client.messages.stream(model="qwen3", max_tokens=100, messages=HI) as stream:
            text = "".join(stream.text_stream)
            message = stream.get_final_message()
        assert len(text.split()) == 4
        assert message.content[-1].text == text  # type: ignore[union-attr]
        assert message.stop_reason == "end_turn"
        client.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_messages_scripted_tool_round_trip(engine: str) -> None:
    with replica(engine) as (srv, c):
        client = claude(srv)
        ask: dict[str, Any] = {"model": "qwen3", "max_tokens": 500, "tools": [BASH]}
        turn = [{"role": "user", "content": [{"type": "text", "text": ASK_BASH}]}]
        called = client.messages.create(**ask, messages=turn)
        assert called.stop_reason == "tool_use"
        use = called.content[-1]
        assert use.type == "tool_use"
        assert (use.name, use.input) == ("Bash", {"command": "echo hi"})
        result = {"type": "tool_result", "tool_use_id": use.id, "content": OUTPUT}
        history = [
            *turn,
            {"role": "assistant", "content": called.content},
            {"role": "user", "content": [result]},
        ]
        answered = client.messages.create(**ask, messages=history)
        assert answered.stop_reason == "end_turn"
        assert answered.content[-1].type == "text"
        assert answered.content[-1].text == "tool result: " + OUTPUT[:200]
        # The same loop streamed: the call's input arrives as input_json_delta.
        with client.messages.stream(**ask, messages=turn) as stream:
            streamed = stream.get_final_message()
        assert streamed.content[-1].input == {"command": "echo hi"}  # type: ignore[union-attr]
        body = {**ask, "messages": turn, "stream": True}
        deltas = [
            d["delta"]
            for n, d in named_events(c.post("/v1/messages", json=body).text)
            if n == "content_block_delta"
        ]
        assert orjson.loads(deltas[-1]["partial_json"]) == {"command": "echo hi"}
        # A marker naming a tool the request does not offer is only text.
        other = {**BASH, "name": "Read"}
        plain = client.messages.create(**{**ask, "tools": [other]}, messages=turn)
        assert (plain.stop_reason, plain.content[-1].type) == ("end_turn", "text")
        client.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_messages_count_tokens_matches_the_prompt(engine: str) -> None:
    with replica(engine) as (srv, _):
        client = claude(srv)
        ask: dict[str, Any] = {"model": "qwen3", "messages": HI, "system": LONG_SYSTEM, "tools": [BASH]}
        counted = client.messages.count_tokens(**ask)
        made = client.messages.create(**ask, max_tokens=50)
        assert counted.input_tokens == made.usage.input_tokens > 250  # first request: nothing cached
        smaller = client.messages.count_tokens(model="qwen3", messages=HI)
        assert smaller.input_tokens < counted.input_tokens
        extra = counted.model_extra or {}
        assert ("context_management" in extra) is (engine == "vllm")
        client.close()


def test_vllm_messages_errors_are_anthropic_shaped() -> None:
    with replica("vllm", context=4096) as (srv, c):
        r = c.post("/v1/messages", json={"model": "qwen3", "messages": HI})
        assert r.status_code == 400
        assert r.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
        }
        r = c.post("/v1/messages", json={"model": "claude-x", "max_tokens": 5, "messages": HI})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
        assert "Valid aliases" in r.json()["error"]["message"]
        client = claude(srv)
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model="qwen3", max_tokens=5000, messages=HI)
        assert "max_model_len" in info.value.message
        client.close()
        assert stats(c)["errors"] == 3


def test_llama_messages_defaults_max_tokens_and_keeps_its_error_shape() -> None:
    with replica("llamacpp") as (_, c):
        r = c.post("/v1/messages", json={"model": "qwen3", "messages": HI})
        assert r.status_code == 200
        assert r.json()["stop_reason"] == "end_turn"
        r = c.post("/v1/messages", json={"model": "qwen3", "max_tokens": 5, "messages": "hello"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == 400
        assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("engine", ENGINES)
def test_messages_injected_failures_and_recorded_requests(engine: str) -> None:
    with replica(engine) as (_, c):
        c.post("/sim/config", json={"fail": "503", "fail_count": 1})
        body = {"model": "qwen3", "max_tokens": 5, "messages": HI}
        r = c.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        if engine == "vllm":
            assert r.json() == {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "injected failure"},
            }
        else:
            assert r.json()["error"] == {
                "code": 503,
                "message": "injected failure",
                "type": "unavailable_error",
            }
        assert c.post("/v1/messages?beta=true", json=body).status_code == 200  # as Claude Code sends it
        s = stats(c)
        assert (s["injected"], s["requests"], s["completed"]) == (1, 2, 1)
        assert orjson.loads(s["last_bodies"][0]) == body
        assert s["last_headers"][0]["anthropic-version"] == "2023-06-01"


@pytest.mark.parametrize("engine", ENGINES)
def test_messages_stream_disconnect_aborts_and_frees_the_slot(engine: str) -> None:
    slow = {"time_scale": 1.0, "decode_tps": 20.0, "reasoning_tokens": 0, "answer_tokens": 2000}
    with replica(engine, slots=1, **slow) as (srv, c):
        body = {"model": "qwen3", "max_tokens": 4000, "messages": HI, "stream": True}
        with (
            httpx2.Client(base_url=srv.url, timeout=10) as first,
            first.stream("POST", "/v1/messages", json=body) as r,
        ):
            # The line iterator is kept: one dropped after `next` is closed whenever the garbage
            # collector gets to it, and closing it closes the stream (the client left too early).
            lines = r.iter_lines()
            assert next(lines) == "event: message_start"
            wait_for(lambda: stats(c)["running"] == 1, "the stream to hold the slot")
        wait_for(lambda: stats(c)["aborted"] == 1, "the stream to be aborted")
        wait_for(lambda: stats(c)["in_flight"] == 0, "the slot to be released")
        assert stats(c)["completed"] == 0


def test_llama_takes_the_anthropic_api_key_header() -> None:
    with replica("llamacpp", api_key="sekret") as (srv, c):
        assert c.post("/v1/messages", json={"messages": HI}, headers={"x-api-key": "nope"}).status_code == 401
        client = claude(srv, "sekret")
        assert client.messages.create(model="qwen3", max_tokens=20, messages=HI).stop_reason == "end_turn"
        client.close()
        assert c.post("/tokenize", json={"content": "x"}).status_code == 401
    with replica("vllm", api_key="sekret") as (srv, c):
        assert (
            c.post("/v1/messages", json={"messages": HI}, headers={"x-api-key": "sekret"}).status_code == 401
        )
        client = anthropic.Anthropic(base_url=srv.url, auth_token="sekret", max_retries=0)
        assert client.messages.create(model="qwen3", max_tokens=20, messages=HI).stop_reason == "end_turn"
        client.close()


# --- OpenAI Responses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_responses_create_usage_and_store(engine: str) -> None:
    with replica(engine) as (srv, c):
        client = gpt(srv)
        ask: dict[str, Any] = {"model": "qwen3", "instructions": LONG_SYSTEM, "reasoning": {"effort": "none"}}
        first = client.responses.create(**ask, input="hello")
        assert first.id.startswith("resp_")
        assert (first.object, first.status, first.model, first.incomplete_details) == (
            "response",
            "completed",
            "qwen3",
            None,
        )
        assert [item.type for item in first.output] == ["message"]
        assert len(first.output_text.split()) == 4
        assert first.usage is not None
        assert first.usage.output_tokens == 4
        assert first.usage.total_tokens == first.usage.input_tokens + 4
        assert first.usage.output_tokens_details.reasoning_tokens == 0
        second = client.responses.create(
            **ask,
            input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}],
        )
        assert second.usage is not None
        assert second.usage.input_tokens == first.usage.input_tokens  # cached tokens are counted in
        assert second.usage.input_tokens_details.cached_tokens > 0
        stored = c.get(f"/v1/responses/{first.id}")
        assert stored.status_code == 200
        assert stored.json()["output"][0]["content"][0]["text"] == first.output_text
        assert client.responses.retrieve(second.id).output_text == second.output_text
        cancel = c.post(f"/v1/responses/{first.id}/cancel")
        assert cancel.status_code == 400
        assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
        deleted = c.delete(f"/v1/responses/{first.id}")
        assert deleted.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
        for method in ("GET", "DELETE"):
            gone = c.request(method, f"/v1/responses/{first.id}")
            assert gone.status_code == 404
            assert gone.json()["error"]["message"] == f"Response with id '{first.id}' not found."
        unstored = client.responses.create(**ask, input="hello", store=False)
        assert c.get(f"/v1/responses/{unstored.id}").status_code == 404
        client.close()


def test_responses_keep_only_the_last_64() -> None:
    with replica("llamacpp", reasoning_tokens=0, answer_tokens=1) as (_, c):
        ids = [c.post("/v1/responses", json={"input": "hi"}).json()["id"] for _ in range(66)]
        assert [c.get(f"/v1/responses/{rid}").status_code for rid in ids[:3]] == [404, 404, 200]
        assert c.get(f"/v1/responses/{ids[-1]}").status_code == 200


@pytest.mark.parametrize("engine", ENGINES)
def test_responses_stream_events(engine: str) -> None:
    with replica(engine) as (srv, c):
        r = c.post("/v1/responses", json={"model": "qwen3", "input": "hello", "stream": True})
        assert r.status_code == 200
        events = named_events(r.text)
        assert all(name == data["type"] for name, data in events)
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        names = [name for name, _ in events]
        assert names[:2] == ["response.created", "response.in_progress"]
        assert events[0][1]["response"]["status"] == "in_progress"
        message_at = names.index("response.content_part.added") - 1
        assert names[message_at:] == [
            "response.output_item.added",
            "response.content_part.added",
            *["response.output_text.delta"] * 4,
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert names.count("response.reasoning_text.delta") == 6
        done = events[-1][1]["response"]
        assert done["status"] == "completed"
        assert done["usage"]["output_tokens"] == 10
        assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
        assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
        text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
        assert text == done["output"][1]["content"][0]["text"]
        client = gpt(srv)
        typed = list(client.responses.create(model="qwen3", input="hello", stream=True))
        assert typed[-1].type == "response.completed"
        with client.responses.stream(model="qwen3", input="hello") as stream:
            final = stream.get_final_response()
        assert len(final.output_text.split()) == 4
        assert c.get(f"/v1/responses/{final.id}").json()["status"] == "completed"
        client.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_responses_scripted_function_round_trip(engine: str) -> None:
    with replica(engine) as (srv, c):
        client = gpt(srv)
        first = client.responses.create(model="qwen3", input=ASK_BASH, tools=[BASH_FN])  # type: ignore[list-item]
        call = first.output[-1]
        assert call.type == "function_call"
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")  # type: ignore[union-attr]
        assert (call.name, orjson.loads(call.arguments), call.status) == (
            "Bash",
            {"command": "echo hi"},
            "completed",
        )
        turns = [
            {"role": "user", "content": ASK_BASH},
            {"type": "function_call", "call_id": call.call_id, "name": "Bash", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": OUTPUT},
        ]
        second = client.responses.create(model="qwen3", input=turns, tools=[BASH_FN])  # type: ignore[arg-type,list-item]
        assert second.output_text == "tool result: " + OUTPUT[:200]
        # previous_response_id carries the stored conversation on.
        followed = client.responses.create(
            model="qwen3",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "done"}],
            tools=[BASH_FN],  # type: ignore[list-item]
        )
        assert followed.output_text == "tool result: done"
        assert followed.usage is not None and first.usage is not None
        assert followed.usage.input_tokens > first.usage.input_tokens
        missing = c.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
        assert missing.status_code == 404
        body = {"model": "qwen3", "input": ASK_BASH, "tools": [BASH_FN], "stream": True}
        events = named_events(c.post("/v1/responses", json=body).text)
        names = [n for n, _ in events]
        assert "response.function_call_arguments.delta" in names
        args_done = events[names.index("response.function_call_arguments.done")][1]
        assert (args_done["name"], orjson.loads(args_done["arguments"])) == ("Bash", {"command": "echo hi"})
        assert events[-1][1]["response"]["output"][-1]["type"] == "function_call"
        client.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_responses_thinking_trap_is_incomplete(engine: str) -> None:
    with replica(engine, reasoning_tokens=300, answer_tokens=24) as (srv, _):
        client = gpt(srv)
        trap = client.responses.create(model="qwen3", input="hello", max_output_tokens=200)
        assert trap.status == "incomplete"
        assert trap.incomplete_details is not None and trap.incomplete_details.reason == "max_output_tokens"
        assert [item.type for item in trap.output] == ["reasoning"]
        assert trap.usage is not None and trap.usage.output_tokens == 200
        assert trap.output_text == ""
        off = client.responses.create(
            model="qwen3", input="hello", max_output_tokens=200, reasoning={"effort": "none"}
        )
        assert (off.status, [item.type for item in off.output]) == ("completed", ["message"])
        kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
        injected = client.responses.create(
            model="qwen3", input="hello", max_output_tokens=200, extra_body=kwargs
        )
        assert injected.status == "completed"
        assert len(injected.output_text.split()) == 24
        client.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_responses_errors_in_the_engines_shape(engine: str) -> None:
    with replica(engine) as (_, c):
        r = c.post("/v1/responses", json={"model": "qwen3"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == 400
        assert "type" not in r.json()  # OpenAI-shaped (vLLM) or llama-server's own, never Anthropic's
        item = {"type": "additional_tools", "tools": []}
        r = c.post("/v1/responses", json={"input": [item, {"role": "user", "content": "hi"}]})
        if engine == "llamacpp":
            assert (r.status_code, r.json()["error"]["message"]) == (400, "Cannot determine type of 'item'")
        else:
            assert r.status_code == 200
        c.post("/sim/config", json={"fail": "500", "fail_count": 1})
        r = c.post("/v1/responses", json={"input": "hi"})
        assert (r.status_code, r.json()["error"]["code"]) == (500, 500)
        assert stats(c)["injected"] == 1


# --- embeddings, tokenize, infill, rerank -------------------------------------------------------------


@pytest.mark.parametrize(("engine", "status"), [("vllm", 404), ("llamacpp", 501)])
def test_embeddings_off_by_default(engine: str, status: int) -> None:
    with replica(engine) as (srv, _):
        client = gpt(srv)
        with pytest.raises(openai.APIStatusError) as info:
            client.embeddings.create(model="qwen3", input="hello")
        assert info.value.status_code == status
        body: Any = info.value.body
        expected = "NotFoundError" if engine == "vllm" else "not_supported_error"
        assert body["type"] == expected if "type" in body else body["error"]["type"] == expected
        client.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_embeddings_are_deterministic_vectors(engine: str) -> None:
    with replica(engine, embeddings=True) as (srv, c):
        client = gpt(srv)
        made = client.embeddings.create(
            model="qwen3", input=["hello", "world", "hello"]
        )  # base64 on the wire
        vectors = [d.embedding for d in made.data]
        assert [d.index for d in made.data] == [0, 1, 2]
        assert [len(v) for v in vectors] == [8, 8, 8]
        assert vectors[0] == pytest.approx(vectors[2]) and vectors[0] != pytest.approx(vectors[1])
        assert sum(x * x for x in vectors[0]) == pytest.approx(1.0, abs=1e-5)
        assert made.usage.prompt_tokens == made.usage.total_tokens == 6  # 2 tokens each
        floats = c.post("/v1/embeddings", json={"input": "hello", "encoding_format": "float"}).json()
        assert floats["data"][0]["embedding"] == pytest.approx(vectors[0], abs=1e-6)
        packed = c.post("/v1/embeddings", json={"input": "hello", "encoding_format": "base64"}).json()
        unpacked = struct.unpack("<8f", base64.b64decode(packed["data"][0]["embedding"]))
        assert list(unpacked) == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)
        if engine == "llamacpp":
            native = c.post("/embeddings", json={"content": "hello"}).json()
            assert native[0]["embedding"][0] == pytest.approx(vectors[0], abs=1e-6)
        client.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_tokenize_round_trips_and_matches_prompt_ids(engine: str) -> None:
    with replica(engine) as (_, c):
        text = "hello, wörld!"
        sent = {"content": text} if engine == "llamacpp" else {"prompt": text}
        tokens = c.post("/tokenize", json=sent).json()
        ids = tokens["tokens"]
        assert len(ids) == (len(text.encode()) + 3) // 4
        if engine == "vllm":
            assert (tokens["count"], tokens["max_model_len"]) == (len(ids), 32768)
        back = c.post("/detokenize", json={"tokens": ids}).json()
        assert back == ({"prompt": text} if engine == "vllm" else {"content": text})
        # The ids are the ones /v1/completions takes: the same prompt, the same count.
        done = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}).json()
        assert done["usage"]["prompt_tokens"] == len(ids)
        assert c.post("/detokenize", json={"tokens": "nope"}).status_code == 400


def test_vllm_tokenize_messages_renders_the_chat_prompt() -> None:
    with replica("vllm") as (_, c):
        chat = c.post("/tokenize", json={"messages": HI}).json()
        done = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1}).json()
        assert chat["count"] == done["usage"]["prompt_tokens"]
        assert c.post("/tokenize", json={}).status_code == 400


def test_llama_infill_plain_and_streamed() -> None:
    with replica("llamacpp") as (_, c):
        body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 3}
        done = c.post("/infill", json=body).json()
        assert (done["stop"], done["stop_type"], done["tokens_predicted"]) == (True, "limit", 3)
        assert len(done["content"].split()) == 3
        assert "<|fim_prefix|>def add(a, b)" in done["prompt"]
        assert done["timings"]["predicted_n"] == 3
        r = c.post("/infill", json={**body, "stream": True})
        chunks = [orjson.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert "[DONE]" not in r.text
        assert [ch["stop"] for ch in chunks] == [False, False, False, True]
        assert len("".join(ch["content"] for ch in chunks).split()) == 3
        r = c.post("/infill", json={"input_suffix": ""})
        assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_request_error")


def test_rerank_only_on_llama_with_the_flag() -> None:
    ask = {"query": "cache slot", "documents": ["a river", "the cache slot", "a cache"], "top_n": 2}
    with replica("llamacpp") as (_, c):
        r = c.post("/v1/rerank", json=ask)
        assert (r.status_code, r.json()["error"]["type"]) == (501, "not_supported_error")
    with replica("llamacpp", reranking=True) as (_, c):
        for path in ("/rerank", "/v1/rerank"):
            ranked = c.post(path, json=ask).json()
            assert [r["index"] for r in ranked["results"]] == [1, 2]
            assert ranked["results"][0]["relevance_score"] > ranked["results"][1]["relevance_score"]
    with replica("vllm") as (_, c):
        assert c.post("/v1/rerank", json=ask).status_code == 404


@pytest.mark.parametrize("engine", ENGINES)
def test_injected_failures_reach_every_new_endpoint(engine: str) -> None:
    with replica(engine, embeddings=True) as (_, c):
        c.post("/sim/config", json={"fail": "500"})
        posts = {
            "/tokenize": {"content": "x", "prompt": "x"},
            "/v1/embeddings": {"input": "x"},
            "/v1/messages/count_tokens": {"messages": HI},
        }
        for path, body in posts.items():
            assert c.post(path, json=body).status_code == 500, path
        c.post("/sim/config", json={"fail": None})
        assert all(c.post(path, json=body).status_code == 200 for path, body in posts.items())
        assert stats(c)["injected"] == 3


# --- chat completions: the same scripted loop ---------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_chat_scripted_tool_loop(engine: str) -> None:
    tool = {"type": "function", "function": {"name": "Bash", "parameters": BASH["input_schema"]}}
    with replica(engine) as (_, c):
        ask = [{"role": "user", "content": ASK_BASH}]
        choice = c.post("/v1/chat/completions", json={"messages": ask, "tools": [tool]}).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        call = choice["message"]["tool_calls"][0]
        assert call["function"]["name"] == "Bash"
        assert orjson.loads(call["function"]["arguments"]) == {
            "command": "echo hi"
        }  # not the schema's sample
        history = [
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": OUTPUT},
        ]
        answered = c.post("/v1/chat/completions", json={"messages": history, "tools": [tool]}).json()
        assert answered["choices"][0]["finish_reason"] == "stop"
        assert answered["choices"][0]["message"]["content"] == "tool result: " + OUTPUT[:200]
        cut = c.post(
            "/v1/chat/completions", json={"messages": history, "tools": [tool], "max_tokens": 8}
        ).json()
        assert cut["choices"][0]["finish_reason"] == "length"
        unknown = [{"role": "user", "content": "[[tool Nope {}]]"}]
        plain = c.post("/v1/chat/completions", json={"messages": unknown, "tools": [tool]}).json()["choices"][
            0
        ]
        assert plain["finish_reason"] == "stop"
        assert not plain["message"].get("tool_calls")
