import orjson
import pytest

from gateway.dialects.answer import Answer
from gateway.dialects.anthropic import ANTHROPIC, billing_header, error_type, system_in_turns
from gateway.errors import BadRequest, RateLimited
from gateway.relay.sse import SseRelay


def test_usage_counts_cached_tokens_into_the_prompt() -> None:
    answer = Answer()
    ANTHROPIC.read_whole(
        answer,
        {
            "type": "message",
            "content": [{"type": "text", "text": "hi"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 31, "cache_read_input_tokens": 6019, "output_tokens": 4},
        },
    )
    assert (answer.prompt_tokens, answer.cached_tokens, answer.completion_tokens) == (6050, 6019, 4)
    assert answer.content_seen and answer.finish_reason == "end_turn"


def test_thinking_only_answer_cut_by_the_budget_is_the_trap() -> None:
    answer = Answer()
    ANTHROPIC.read_whole(
        answer,
        {"content": [{"type": "thinking", "thinking": "hmm"}], "stop_reason": "max_tokens", "usage": {}},
    )
    assert answer.finish_reason == "length" and answer.thinking_trap


def test_tool_use_is_an_answer() -> None:
    answer = Answer()
    ANTHROPIC.read_whole(answer, {"content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}]})
    assert answer.content_seen and not answer.thinking_trap


def _event(name: str, data: dict[str, object]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def test_stream_usage_and_stop_reason_are_read_and_bytes_pass_unchanged() -> None:
    stream = b"".join(
        [
            _event(
                "message_start",
                {
                    "type": "message_start",
                    "message": {"usage": {"input_tokens": 5, "cache_read_input_tokens": 95}},
                },
            ),
            _event("content_block_start", {"type": "content_block_start", "index": 0}),
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}},
            ),
            _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn"},
                    "usage": {"output_tokens": 7},
                },
            ),
            _event("message_stop", {"type": "message_stop"}),
        ]
    )
    answer = Answer()
    relay = SseRelay(answer, drop_usage=True, clock=lambda: 1.0, dialect=ANTHROPIC)
    out = b"".join(relay.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + relay.flush()
    assert out == stream
    assert (answer.prompt_tokens, answer.cached_tokens, answer.completion_tokens) == (100, 95, 7)
    assert answer.finish_reason == "end_turn" and answer.content_seen
    assert relay.first_token_at == 1.0


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
    ],
)
def test_errors_use_anthropic_types(status: int, kind: str) -> None:
    body = orjson.loads(ANTHROPIC.error_body(status, "whatever", "m", "c", None))
    assert body == {"type": "error", "error": {"type": kind, "message": "m"}}
    assert error_type(status) == kind


def test_a_broken_stream_ends_with_an_error_event() -> None:
    event = ANTHROPIC.stream_error("broke", "upstream_disconnected")
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert orjson.loads(event.split(b"data: ", 1)[1])["error"]["type"] == "api_error"


def test_thinking_is_turned_off_unless_the_client_asked() -> None:
    body: dict[str, object] = {"messages": [{"role": "user", "content": "x"}]}
    notes = ANTHROPIC.thinking(body, on=False, override=False)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert [kind for kind, _ in notes] == ["thinking_off"]
    asked: dict[str, object] = {"thinking": {"type": "enabled", "budget_tokens": 2048}}
    assert ANTHROPIC.thinking(asked, on=False, override=False) == []
    assert asked == {"thinking": {"type": "enabled", "budget_tokens": 2048}}
    thinker: dict[str, object] = {"thinking": {"type": "adaptive"}}
    assert ANTHROPIC.thinking(thinker, on=True, override=False) == []
    assert thinker == {"thinking": {"type": "adaptive"}}


@pytest.mark.parametrize(
    ("thinking", "override"), [({"type": "adaptive"}, False), ({"type": "enabled", "budget_tokens": 9}, True)]
)
def test_adaptive_leaves_it_to_the_preset_and_override_replaces_any_choice(
    thinking: dict[str, object], override: bool
) -> None:
    body: dict[str, object] = {"thinking": thinking}
    notes = ANTHROPIC.thinking(body, on=False, override=override)
    assert body["thinking"] == {"type": "disabled"}
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert [kind for kind, _ in notes] == ["thinking_overridden", "thinking_off"]


def test_system_messages_after_the_first_turn_become_user_turns_in_place() -> None:
    first = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    body = {"messages": [first, {"role": "system", "content": "reminder"}, {"role": "user", "content": "go"}]}
    notes = system_in_turns(body)
    assert body["messages"][0] is first
    assert body["messages"][1] == {"role": "user", "content": "reminder"}
    assert notes == [("system_in_turns", "system_in_turns=1")]
    assert system_in_turns(body) == []


def test_anthropic_only_fields_are_dropped_only_when_wanted() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "context_management": {"edits": []}}
    assert ANTHROPIC.fixes(dict(body), frozenset()) == []
    notes = ANTHROPIC.fixes(body, frozenset({"anthropic_only_fields"}))
    assert "context_management" not in body and notes[0][0] == "anthropic_only_fields"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": "x"},
        {"messages": [{}], "system": 3},
        {"messages": [{}], "thinking": "on"},
    ],
)
def test_bad_bodies_are_rejected(body: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        ANTHROPIC.check(body, "messages")


@pytest.mark.parametrize("suffix", ["1c0; cc_entrypoint=cli;", "7f3; cc_entrypoint=cli; cch=00ab1;"])
def test_the_billing_block_goes_and_the_rest_of_the_system_prompt_stays(suffix: str) -> None:
    rest = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    body = {
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}"},
            *rest,
        ]
    }
    notes = billing_header(body)
    assert body["system"] == rest and body["system"][0] is rest[0]
    assert notes == [("billing_header", "billing_header=removed")]
    assert billing_header(body) == []


def test_a_wait_claude_code_would_retry_within_is_a_429_it_should_retry_with_the_hint() -> None:
    limited = RateLimited(
        "Over the key's requests per minute", code="requests_per_minute", headers={"retry-after": "7"}
    )
    reply = ANTHROPIC.error_reply(limited, streaming=True, opened=False, request_id="r1", model="coder")
    headers = dict(reply.headers)
    assert reply.status == 429 and headers["retry-after"] == "7" and headers["x-should-retry"] == "true"
    assert orjson.loads(reply.body)["error"]["type"] == "rate_limit_error"


def test_a_wait_past_a_minute_tells_claude_code_not_to_retry_and_keeps_the_true_wait() -> None:
    # Claude Code gives up at once on a retry-after over 60 s; a day's token limit cannot clear sooner.
    limited = RateLimited(
        "Over the key's tokens per day", code="tokens_per_day", headers={"retry-after": "3600"}
    )
    reply = ANTHROPIC.error_reply(limited, streaming=False, opened=False, request_id="r1", model="coder")
    headers = dict(reply.headers)
    assert reply.status == 429 and headers["x-should-retry"] == "false"
    assert headers["retry-after"] == "3600"
