"""A Messages stop on a budget the gateway lowered to the context's room reads as a full context."""

from __future__ import annotations

from gateway.answers.changes import Changes
from gateway.answers.context_stop import CONTEXT_FULL, ContextStop
from gateway.answers.events import make


def delta(stop_reason: str) -> dict[str, object]:
    return {"type": "message_delta", "delta": {"stop_reason": stop_reason}, "usage": {"output_tokens": 9}}


def test_unarmed_it_changes_nothing_and_asks_for_no_parsing() -> None:
    stop = ContextStop()
    assert not Changes([stop])  # the relay passes the replica's bytes
    # Another change may still have the answer parsed: this one leaves the stop as it is.
    assert stop.whole({"stop_reason": "max_tokens"}) == {"stop_reason": "max_tokens"}
    [event] = stop.stream(make(delta("max_tokens")))
    assert event.data is not None and event.data["delta"]["stop_reason"] == "max_tokens"


def test_armed_a_budget_stop_becomes_a_full_context_whole_and_streamed() -> None:
    stop = ContextStop()
    stop.arm(True)
    assert Changes([stop]).wants(b'data: {"delta":{"stop_reason":"max_tokens"}}\n\n')
    assert stop.whole({"stop_reason": "max_tokens", "content": []})["stop_reason"] == CONTEXT_FULL
    [event] = stop.stream(make(delta("max_tokens")))
    assert event.data is not None and event.data["delta"]["stop_reason"] == CONTEXT_FULL
    assert event.data["usage"] == {"output_tokens": 9}
    assert CONTEXT_FULL.encode() in event.encode()


def test_other_stops_pass_unchanged() -> None:
    stop = ContextStop()
    stop.arm(True)
    for reason in ("end_turn", "tool_use", "stop_sequence"):
        assert stop.whole({"stop_reason": reason})["stop_reason"] == reason
        [event] = stop.stream(make(delta(reason)))
        assert event.data is not None and event.data["delta"]["stop_reason"] == reason


def test_a_later_attempt_without_a_lowered_budget_disarms_it() -> None:
    stop = ContextStop()
    stop.arm(True)
    stop.arm(False)  # a retry on a replica whose context leaves the whole budget
    assert stop.done and not Changes([stop])
