"""Tool calls and results in the history: only what the engines refuse is changed (the calls the
history ends with, calls without ids), every other history keeps its bytes; with `tool_pairing`,
every call gets its result and a result without its call is dropped."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dialects.tool_history import INTERRUPTED, history_id, tool_history

USER = {"role": "user", "content": "list the files"}


def chat_call(id_: str | None) -> dict[str, Any]:
    made: dict[str, Any] = {"type": "function", "function": {"name": "Bash", "arguments": "{}"}}
    if id_ is not None:
        made["id"] = id_
    return made


def assistant(*ids: str | None) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [chat_call(i) for i in ids]}


def result(id_: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": id_, "content": "out"}


def run(body: dict[str, Any], form: str, strict: bool = False) -> tuple[dict[str, Any], list[Any]]:
    sent = copy.deepcopy(body)
    notes = tool_history(sent, form, strict=strict)
    return sent, notes


def test_a_chat_history_that_ends_with_calls_gets_a_result_for_each() -> None:
    body = {"messages": [USER, assistant("a", "b")]}
    original = copy.deepcopy(body)
    sent, notes = run(body, "chat")
    assert sent["messages"][-2:] == [
        {"role": "tool", "tool_call_id": "a", "content": INTERRUPTED},
        {"role": "tool", "tool_call_id": "b", "content": INTERRUPTED},
    ]
    assert notes == [("tool_history", "calls_answered=2")]
    assert body == original


def test_the_clients_body_is_left_as_it_came() -> None:
    messages = [USER, assistant("a")]
    body = {"messages": messages}
    assert tool_history(body, "chat") == [("tool_history", "calls_answered=1")]
    assert messages == [USER, assistant("a")] and len(body["messages"]) == 3


@pytest.mark.parametrize(
    "messages",
    [
        [USER, assistant("a"), result("a"), USER],  # answered
        [USER, assistant("a"), USER],  # an orphan in the middle: both engines accept it
        [USER, {"role": "assistant", "content": "ok"}, result("x"), USER],  # a result without its call
        [USER, assistant("a", "a"), result("a"), result("a"), USER],  # repeated ids
        [USER, assistant(""), result(""), USER],  # an empty id is accepted
    ],
)
def test_histories_the_engines_accept_keep_their_bytes(messages: list[Any]) -> None:
    body = {"messages": messages}
    sent, notes = run(body, "chat")
    assert notes == [] and sent == body


def test_a_chat_call_without_an_id_gets_one_from_its_position_on_every_turn() -> None:
    body = {"messages": [USER, assistant(None), result("z"), USER]}
    first, notes = run(body, "chat")
    assert first["messages"][1]["tool_calls"][0]["id"] == history_id(1, 0)
    assert notes == [("tool_history", "ids_minted=1")]
    longer = {"messages": [*body["messages"], assistant("b"), result("b"), USER]}
    second, _ = run(longer, "chat")
    assert second["messages"][:4] == first["messages"]  # the same bytes as the turn before


def test_a_second_pass_changes_nothing() -> None:
    for body, form in (
        ({"messages": [USER, assistant(None, "b")]}, "chat"),
        (
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}],
                    },
                ]
            },
            "messages",
        ),
        ({"input": [{"type": "function_call", "name": "Bash", "arguments": "{}"}]}, "responses"),
    ):
        once, _ = run(body, form)
        twice, notes = run(once, form)
        assert notes == [] and twice == once


def test_a_messages_history_that_ends_with_tool_use_gets_error_results() -> None:
    last = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "running"},
            {"type": "tool_use", "id": "t1", "name": "Bash", "input": {}},
        ],
    }
    sent, notes = run({"messages": [USER, last]}, "messages")
    assert sent["messages"][-1] == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": INTERRUPTED, "is_error": True}],
    }
    assert notes == [("tool_history", "calls_answered=1")]
    middle = {"messages": [USER, last, USER]}
    assert run(middle, "messages") == (middle, [])


def fc(call_id: str | None) -> dict[str, Any]:
    made: dict[str, Any] = {"type": "function_call", "name": "Bash", "arguments": "{}"}
    if call_id is not None:
        made["call_id"] = call_id
    return made


def fo(call_id: str | None) -> dict[str, Any]:
    made: dict[str, Any] = {"type": "function_call_output", "output": "out"}
    if call_id is not None:
        made["call_id"] = call_id
    return made


UI = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}


def test_a_responses_history_that_ends_with_calls_gets_outputs_for_those() -> None:
    sent, notes = run({"input": [UI, fc("a"), UI, fc("b"), fc("c")]}, "responses")
    assert sent["input"][-2:] == [
        {"type": "function_call_output", "call_id": "b", "output": INTERRUPTED},
        {"type": "function_call_output", "call_id": "c", "output": INTERRUPTED},
    ]
    assert notes == [("tool_history", "calls_answered=2")]  # the orphan in the middle is left


def test_responses_calls_and_outputs_without_call_ids_get_them_paired() -> None:
    sent, notes = run({"input": [UI, fc(None), fo(None), UI]}, "responses")
    call, output = sent["input"][1:3]
    assert call["call_id"] == output["call_id"] == history_id(1, 0)
    assert notes == [("tool_history", "ids_minted=2")]


def test_tool_pairing_answers_every_call_and_drops_results_without_theirs() -> None:
    messages = [USER, assistant("a", "b"), result("a"), result("x"), USER, assistant("c"), USER]
    sent, notes = run({"messages": messages}, "chat", strict=True)
    roles = [(m["role"], m.get("tool_call_id")) for m in sent["messages"]]
    assert roles == [
        ("user", None),
        ("assistant", None),
        ("tool", "a"),
        ("tool", "b"),  # answered right after the results that came
        ("user", None),
        ("assistant", None),
        ("tool", "c"),
        ("user", None),
    ]
    assert notes == [("tool_history", "calls_answered=2,results_dropped=1")]


def test_tool_pairing_in_messages_puts_the_results_first_in_the_answering_turn() -> None:
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]}
    stray = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "zz", "content": "x"},
            {"type": "text", "text": "go on"},
        ],
    }
    sent, notes = run({"messages": [USER, call, stray]}, "messages", strict=True)
    assert sent["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "t1", "content": INTERRUPTED, "is_error": True},
        {"type": "text", "text": "go on"},
    ]
    assert notes == [("tool_history", "calls_answered=1,results_dropped=1")]


def test_tool_pairing_in_responses() -> None:
    sent, notes = run({"input": [UI, fc("a"), UI, fo("zz"), fc("b"), fo("b")]}, "responses", strict=True)
    kinds = [(i.get("type"), i.get("call_id")) for i in sent["input"]]
    assert kinds == [
        ("message", None),
        ("function_call", "a"),
        ("function_call_output", "a"),
        ("message", None),
        ("function_call", "b"),
        ("function_call_output", "b"),
    ]
    assert notes == [("tool_history", "calls_answered=1,results_dropped=1")]


def paired_turn_by_turn(messages: list[Any]) -> tuple[list[Any], int, int]:
    """The `tool_pairing` rule for Messages as first written, every user turn rebuilt and compared:
    (the history, results answered for the gateway, results dropped)."""
    out: list[Any] = []
    answered = dropped = 0
    pending: list[Any] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user" and isinstance(message.get("content"), str) and pending:
            message = {**message, "content": [{"type": "text", "text": message["content"]}]}
        if role == "user" and isinstance(message.get("content"), list):
            content = message["content"]
            kept = []
            for block in content:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    if block.get("tool_use_id") not in pending:
                        dropped += 1
                        continue
                    pending.remove(block.get("tool_use_id"))
                kept.append(block)
            kept = [interrupted(i) for i in pending] + kept
            answered += len(pending)
            pending = []
            if len(kept) != len(content) or any(a is not b for a, b in zip(kept, content, strict=True)):
                if not kept:
                    continue
                message = {**message, "content": kept}
        elif pending:
            out.append({"role": "user", "content": [interrupted(i) for i in pending]})
            answered += len(pending)
            pending = []
        if role == "assistant":
            content = message.get("content")
            pending = [
                b.get("id")
                for b in (content if isinstance(content, list) else [])
                if isinstance(b, dict) and b.get("type") == "tool_use"
            ]
        out.append(message)
    if pending:
        out.append({"role": "user", "content": [interrupted(i) for i in pending]})
        answered += len(pending)
    return out, answered, dropped


def history_notes(minted: int, answered: int, dropped: int) -> list[tuple[str, str]]:
    """The `x-gateway-rewrites` note for these counts (none counted: no note)."""
    named = (("ids_minted", minted), ("calls_answered", answered), ("results_dropped", dropped))
    counts = [f"{name}={count}" for name, count in named if count]
    return [("tool_history", ",".join(counts))] if counts else []


def interrupted(tool_use_id: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": INTERRUPTED, "is_error": True}


IDS = st.sampled_from(["t1", "t2", "t3", None])
BLOCKS = st.lists(
    st.one_of(
        st.builds(lambda i: {"type": "tool_use", "id": i, "name": "Bash", "input": {}}, IDS),
        st.builds(lambda i: {"type": "tool_result", "tool_use_id": i, "content": "out"}, IDS),
        st.just({"type": "text", "text": "x"}),
        st.just("not a block"),
    ),
    max_size=4,
)
TURNS = st.lists(
    st.one_of(
        st.builds(lambda c: {"role": "assistant", "content": c}, st.one_of(BLOCKS, st.just("text"))),
        st.builds(lambda c: {"role": "user", "content": c}, st.one_of(BLOCKS, st.just("text"))),
        st.just({"role": "system", "content": "s"}),
        st.just("not a turn"),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=400, deadline=None)
@given(messages=TURNS)
def test_pairing_a_messages_history_matches_rebuilding_every_turn(messages: list[Any]) -> None:
    body = {"messages": messages}
    sent = copy.deepcopy(body)
    notes = tool_history(body, "messages", strict=True)
    expected, answered, dropped = paired_turn_by_turn(messages)
    if answered or dropped:
        assert body["messages"] == expected
        assert notes == history_notes(0, answered, dropped)
        # A turn the rule left alone is the very object the client sent (copy-on-write).
        kept = [any(turn is sent_turn for sent_turn in messages) for turn in expected]
        assert [a is b for a, b in zip(body["messages"], expected, strict=True)] == kept
    else:
        assert body["messages"] is messages and notes == []
    assert messages == sent["messages"]  # the client's history itself is never edited


def chat_turn_by_turn(messages: list[Any], strict: bool) -> tuple[list[Any], int, int, int]:
    """The chat rule as first written, every call list rebuilt and compared: (the history, ids
    minted, results answered for the gateway, results dropped)."""
    out: list[Any] = []
    minted = answered = dropped = 0
    pending: list[str] = []
    for position, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "tool" and strict:
            given = message.get("tool_call_id")
            if not isinstance(given, str) and pending:
                given = pending[0]
                message = {**message, "tool_call_id": given}
            if given not in pending:
                dropped += 1
                continue
            pending.remove(given)
        elif role != "tool":
            if strict and pending:
                out += [{"role": "tool", "tool_call_id": i, "content": INTERRUPTED} for i in pending]
                answered += len(pending)
            pending = []
        calls = message.get("tool_calls") if role == "assistant" else None
        if isinstance(calls, list) and calls:
            fixed = [
                {**c, "id": history_id(position, n)}
                if isinstance(c, dict) and not isinstance(c.get("id"), str)
                else c
                for n, c in enumerate(calls)
            ]
            changed = sum(a is not b for a, b in zip(fixed, calls, strict=True))
            if changed:
                message = {**message, "tool_calls": fixed}
                minted += changed
            pending = [str(c.get("id")) for c in fixed if isinstance(c, dict)]
        out.append(message)
    last = out[-1] if out else None
    if pending and (strict or (isinstance(last, dict) and last.get("role") == "assistant")):
        out += [{"role": "tool", "tool_call_id": i, "content": INTERRUPTED} for i in pending]
        answered += len(pending)
    return out, minted, answered, dropped


CALLS = st.lists(
    st.one_of(
        st.builds(
            lambda i: {"type": "function", "function": {"name": "Bash"}, **({} if i is None else {"id": i})},
            IDS,
        ),
        st.just({"type": "function", "id": 7}),
        st.just("not a call"),
    ),
    max_size=3,
)
CHAT_TURNS = st.lists(
    st.one_of(
        st.builds(lambda c: {"role": "assistant", "content": "", "tool_calls": c}, CALLS),
        st.builds(
            lambda i: {"role": "tool", "content": "out", **({} if i is None else {"tool_call_id": i})}, IDS
        ),
        st.just({"role": "user", "content": "go on"}),
        st.just("not a turn"),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=400, deadline=None)
@given(messages=CHAT_TURNS, strict=st.booleans())
def test_a_chat_history_matches_rebuilding_every_call_list(messages: list[Any], strict: bool) -> None:
    body = {"messages": messages}
    sent = copy.deepcopy(body)
    notes = tool_history(body, "chat", strict=strict)
    expected, minted, answered, dropped = chat_turn_by_turn(messages, strict)
    if minted or answered or dropped:
        assert body["messages"] == expected
        kept = [any(turn is sent_turn for sent_turn in messages) for turn in expected]
        assert [a is b for a, b in zip(body["messages"], expected, strict=True)] == kept
        assert notes == history_notes(minted, answered, dropped)
    else:
        assert body["messages"] is messages and notes == []
    assert messages == sent["messages"]
