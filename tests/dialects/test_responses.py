import orjson
import pytest

from gateway.dialects.answer import Answer
from gateway.dialects.responses import RESPONSES, codex_lite, unknown_tool_types
from gateway.errors import BadRequest
from gateway.relay.sse import SseRelay


def _response(**extra: object) -> dict[str, object]:
    return {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}],
        "usage": {
            "input_tokens": 100,
            "output_tokens": 3,
            "input_tokens_details": {"cached_tokens": 64},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
        **extra,
    }


def test_whole_answer_usage_and_id() -> None:
    answer = Answer()
    RESPONSES.read_whole(answer, _response())
    assert (answer.prompt_tokens, answer.cached_tokens, answer.completion_tokens) == (100, 64, 3)
    assert answer.response_id == "resp_1" and answer.content_seen and answer.finish_reason == "stop"


def test_reasoning_only_incomplete_answer_is_the_trap() -> None:
    answer = Answer()
    RESPONSES.read_whole(
        answer,
        _response(
            status="incomplete",
            incomplete_details={"reason": "max_output_tokens"},
            output=[{"type": "reasoning", "summary": []}],
        ),
    )
    assert answer.finish_reason == "length" and answer.thinking_trap


def _event(data: dict[str, object]) -> bytes:
    return b"event: " + str(data["type"]).encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def test_stream_reads_the_completed_event_and_passes_every_byte() -> None:
    stream = b"".join(
        [
            _event({"type": "response.created", "response": {"id": "resp_9", "status": "in_progress"}}),
            _event({"type": "response.output_text.delta", "delta": "h"}),
            _event({"type": "response.completed", "response": _response(id="resp_9")}),
        ]
    )
    answer = Answer()
    relay = SseRelay(answer, drop_usage=True, clock=lambda: 2.0, dialect=RESPONSES)
    out = b"".join(relay.feed(stream[i : i + 5]) for i in range(0, len(stream), 5)) + relay.flush()
    assert out == stream
    assert answer.response_id == "resp_9" and answer.cached_tokens == 64 and answer.content_seen


def test_reasoning_effort_is_the_clients_choice_unless_overridden() -> None:
    body: dict[str, object] = {"input": "x", "reasoning": {"effort": "high", "summary": "auto"}}
    assert RESPONSES.thinking(body, on=False, override=False) == []
    notes = RESPONSES.thinking(body, on=False, override=True)
    assert body["reasoning"] == {"effort": "none", "summary": "auto"}
    assert [k for k, _ in notes] == ["thinking_overridden", "thinking_off"]
    plain: dict[str, object] = {"input": "x", "reasoning": {"summary": "auto"}}
    RESPONSES.thinking(plain, on=False, override=False)
    assert plain["chat_template_kwargs"] == {"enable_thinking": False}
    assert plain["reasoning"] == {"summary": "auto"}


def test_codex_lite_tools_move_to_tools_and_other_items_keep_their_order() -> None:
    first = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]}
    tool = {"type": "function", "name": "shell", "parameters": {}}
    last = {"type": "message", "role": "user", "content": "go"}
    body = {"input": [first, {"type": "additional_tools", "tools": [tool]}, last]}
    notes = codex_lite(body)
    assert body["input"] == [first, last] and body["input"][0] is first
    assert body["tools"] == [tool]
    assert notes == [("codex_lite", "additional_tools=1")]
    assert codex_lite(body) == []


def test_hosted_tool_types_are_dropped_and_namespaces_lifted() -> None:
    fn = {"type": "function", "name": "shell"}
    inner = {"type": "function", "name": "mcp__x"}
    body = {"tools": [fn, {"type": "web_search"}, {"type": "namespace", "name": "mcp", "tools": [inner]}]}
    notes = unknown_tool_types(body)
    assert body["tools"] == [fn, inner]
    assert notes == [("unknown_tool_types", "tools_dropped=2")]
    assert unknown_tool_types(body) == []


@pytest.mark.parametrize(
    "body", [{}, {"input": ""}, {"input": []}, {"input": 3}, {"input": "x", "reasoning": 1}]
)
def test_bad_bodies_are_rejected(body: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        RESPONSES.check(body, "responses")


def test_stream_error_is_a_typed_error_event() -> None:
    event = RESPONSES.stream_error("broke", "upstream_disconnected")
    payload = orjson.loads(event.split(b"data: ", 1)[1])
    assert event.startswith(b"event: error\n")
    assert payload == {"type": "error", "code": "upstream_disconnected", "message": "broke", "param": None}
