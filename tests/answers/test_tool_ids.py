"""Every tool call that leaves the gateway has an id of its own: missing and repeated ids in streamed
parallel calls, ids the history already used, in each dialect, whole and streamed."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.answers.changes import Changes
from gateway.answers.events import parse
from gateway.answers.tool_ids import MAX_USED, ChatIds, Ids, MessagesIds, ResponsesIds, history_ids, mint
from gateway.answers.tool_repair import tool_calls

from .streams import (
    chat_body,
    chat_chunk,
    chat_result,
    messages_body,
    messages_result,
    relayed,
    responses_body,
    responses_result,
    sse,
)


def call(
    index: int | None, id_: str | None, arguments: str = '{"command": "ls"}', name: str | None = "Bash"
) -> dict[str, Any]:
    made: dict[str, Any] = {"type": "function", "function": {"arguments": arguments}}
    if name is not None:
        made["function"]["name"] = name
    if index is not None:
        made["index"] = index
    if id_ is not None:
        made["id"] = id_
    return made


def chat_calls(*deltas: dict[str, Any]) -> list[bytes]:
    return [
        *(chat_chunk({"tool_calls": [d]}) for d in deltas),
        chat_chunk({}, "tool_calls"),
        b"data: [DONE]\n\n",
    ]


def ids_of(calls: list[dict[str, Any]]) -> list[str]:
    return [c["id"] for c in calls]


def test_minted_ids_are_unique_in_their_last_nine_characters() -> None:
    made = {mint("call_") for _ in range(2000)}
    assert len(made) == 2000 and len({m[-9:] for m in made}) == 2000
    assert all(m.startswith("call_") and m[5:].isalnum() and len(m) == 29 for m in made)


def test_streamed_parallel_calls_with_one_id_get_two() -> None:
    events = relayed(Changes([ChatIds(Ids())]), chat_calls(call(0, "call_1"), call(1, "call_1")))
    calls = chat_result(events)["choices"][0]["message"]["tool_calls"]
    assert ids_of(calls)[0] == "call_1" and len(set(ids_of(calls))) == 2


def test_streamed_parallel_calls_without_ids_get_ids() -> None:
    events = relayed(Changes([ChatIds(Ids())]), chat_calls(call(0, None), call(1, "")))
    calls = chat_result(events)["choices"][0]["message"]["tool_calls"]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids_of(calls)) and len(set(ids_of(calls))) == 2


def test_an_id_the_history_already_used_is_replaced() -> None:
    body = chat_body(
        messages=[
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "functions.Bash:0",
                        "type": "function",
                        "function": {"name": "Bash", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "functions.Bash:0", "content": "ok"},
        ]
    )
    changes = Changes()
    tool_calls(body, changes, "chat", repair=False)
    events = relayed(changes, chat_calls(call(0, "functions.Bash:0")))
    [made] = chat_result(events)["choices"][0]["message"]["tool_calls"]
    assert made["id"] != "functions.Bash:0"


def test_a_calls_later_deltas_keep_its_new_id_and_the_arguments_join() -> None:
    deltas = [
        call(0, "dup"),
        call(0, "dup", '"ls"}', name=None),
        call(1, "dup", "{}"),
        call(1, None, "", name=None),
    ]
    deltas[0]["function"]["arguments"] = '{"command": '
    events = relayed(Changes([ChatIds(Ids())]), chat_calls(*deltas))
    calls = chat_result(events)["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ['{"command": "ls"}', "{}"]
    assert calls[0]["id"] == "dup" and calls[1]["id"] != "dup"


def test_two_calls_streamed_on_one_index_get_indexes_of_their_own() -> None:
    events = relayed(Changes([ChatIds(Ids())]), chat_calls(call(0, "a"), call(0, "b", '{"command": "pwd"}')))
    calls = chat_result(events)["choices"][0]["message"]["tool_calls"]
    assert ids_of(calls) == ["a", "b"]
    assert [orjson.loads(c["function"]["arguments"]) for c in calls] == [
        {"command": "ls"},
        {"command": "pwd"},
    ]


def test_a_call_streamed_without_arguments_gets_an_empty_object() -> None:
    events = relayed(Changes([ChatIds(Ids())]), chat_calls(call(0, "a", "")))
    [made] = chat_result(events)["choices"][0]["message"]["tool_calls"]
    assert made["function"]["arguments"] == "{}"


def test_calls_with_good_ids_keep_their_bytes() -> None:
    blocks = chat_calls(call(0, "call_a"), call(1, "call_b"))
    changes = Changes([ChatIds(Ids())])
    assert [e.encode() for b in blocks for e in changes.stream(parse(b))] == blocks


def test_a_whole_chat_answer_gets_unique_ids_and_arguments() -> None:
    payload = {
        "choices": [{"message": {"tool_calls": [call(None, "x"), call(None, "x", ""), call(None, None)]}}]
    }
    calls = ChatIds(Ids()).whole(payload)["choices"][0]["message"]["tool_calls"]
    assert ids_of(calls)[0] == "x" and len(set(ids_of(calls))) == 3
    assert calls[1]["function"]["arguments"] == "{}"


def messages_tool_uses(ids: list[str | None], with_input: bool = True) -> list[bytes]:
    out = []
    for index, id_ in enumerate(ids):
        block: dict[str, Any] = {
            "type": "tool_use",
            "name": "Bash",
            "input": {"command": "ls"} if not with_input else {},
        }
        if id_ is not None:
            block["id"] = id_
        out.append(
            sse(
                {"type": "content_block_start", "index": index, "content_block": block}, "content_block_start"
            )
        )
        if with_input:
            delta = {"type": "input_json_delta", "partial_json": '{"command": "ls"}'}
            out.append(
                sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
            )
        out.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
    end: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use"},
        "usage": {"output_tokens": 3},
    }
    return [*out, sse(end, "message_delta")]


def test_messages_tool_use_blocks_with_one_id_or_none_get_their_own() -> None:
    cases: list[list[str | None]] = [["toolu_1", "toolu_1"], [None, None]]
    for ids in cases:
        events = relayed(Changes([MessagesIds(Ids())]), messages_tool_uses(ids))
        blocks = messages_result(events)["content"]
        assert len({b["id"] for b in blocks}) == 2 and all(b["id"] for b in blocks)
        assert all(b["input"] == {"command": "ls"} for b in blocks)


def test_a_tool_uses_input_given_only_in_its_start_is_streamed_as_a_delta() -> None:
    events = relayed(Changes([MessagesIds(Ids())]), messages_tool_uses(["toolu_1"], with_input=False))
    [block] = messages_result(events)["content"]
    assert block["input"] == {"command": "ls"}


def test_a_whole_messages_answer_gets_unique_tool_use_ids() -> None:
    payload = {"content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}] * 2}
    blocks = MessagesIds(Ids()).whole(payload)["content"]
    assert blocks[0]["id"] == "t" and blocks[1]["id"] != "t"


def responses_calls(call_ids: list[str | None]) -> list[bytes]:
    out = []
    items = []
    for index, call_id in enumerate(call_ids):
        item: dict[str, Any] = {
            "type": "function_call",
            "id": f"fc_{index}",
            "name": "Bash",
            "arguments": '{"command": "ls"}',
            "status": "completed",
        }
        if call_id is not None:
            item["call_id"] = call_id
        out.append(
            sse(
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": {**item, "arguments": ""},
                }
            )
        )
        out.append(sse({"type": "response.output_item.done", "output_index": index, "item": item}))
        items.append(item)
    completed = {
        "type": "response.completed",
        "response": {"id": "r", "output": items, "status": "completed"},
    }
    return [*out, sse(completed)]


def test_responses_call_items_with_one_call_id_or_none_get_their_own_everywhere() -> None:
    cases: list[list[str | None]] = [["call_1", "call_1"], [None, None]]
    for ids in cases:
        events = relayed(Changes([ResponsesIds(Ids())]), responses_calls(ids))
        added = [
            e.data["item"]["call_id"]
            for e in events
            if e.data and e.data["type"] == "response.output_item.added"
        ]
        done = [
            e.data["item"]["call_id"]
            for e in events
            if e.data and e.data["type"] == "response.output_item.done"
        ]
        final = [i["call_id"] for i in responses_result(events)["output"]]
        assert added == done == final and len(set(final)) == 2 and all(final)


def test_a_whole_responses_answer_gets_unique_call_ids() -> None:
    payload = {"output": [{"type": "function_call", "call_id": "c", "arguments": ""}] * 2}
    output = ResponsesIds(Ids()).whole(payload)["output"]
    assert output[0]["call_id"] == "c" and output[1]["call_id"] != "c" and output[1]["arguments"] == "{}"


def test_the_historys_ids_are_read_in_each_dialect() -> None:
    chat = {
        "messages": [
            {"role": "assistant", "tool_calls": [{"id": "a"}]},
            {"role": "tool", "tool_call_id": "a"},
        ]
    }
    assert history_ids(chat, "chat") == ["a", "a"]
    messages = messages_body(
        messages=[
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
        ]
    )
    assert history_ids(messages, "messages") == ["t", "t"]
    responses = responses_body(
        input=[{"type": "function_call", "call_id": "c"}, {"type": "function_call_output", "call_id": "c"}]
    )
    assert history_ids(responses, "responses") == ["c", "c"]


def ids_one_by_one(body: dict[str, Any], form: str) -> list[str]:
    """The rule, read item by item: each id-bearing field in order, kept when a non-empty string."""
    found: list[str] = []
    items = body.get("input" if form == "responses" else "messages")
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        if form == "chat":
            candidates = [item.get("tool_call_id")]
            calls = item.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                candidates.append(call.get("id") if isinstance(call, dict) else None)
        elif form == "messages":
            content = item.get("content")
            candidates = [
                block.get("id") if block.get("type") == "tool_use" else block.get("tool_use_id")
                for block in (content if isinstance(content, list) else [])
                if isinstance(block, dict)
            ]
        else:
            candidates = [item.get("call_id")]
        found += [value for value in candidates if isinstance(value, str) and value]
    return found


ODD = st.one_of(st.none(), st.integers(), st.just(""), st.just([]), st.sampled_from(["a", "b", "toolu_1"]))
BLOCK = st.one_of(
    ODD,
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(["tool_use", "tool_result", "text"]),
            "id": ODD,
            "tool_use_id": ODD,
        },
    ),
)
ITEM = st.one_of(
    ODD,
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "assistant", "tool"]),
            "content": st.one_of(ODD, st.lists(BLOCK, max_size=4)),
            "tool_call_id": ODD,
            "tool_calls": st.one_of(
                ODD, st.lists(st.one_of(ODD, st.fixed_dictionaries({}, optional={"id": ODD})), max_size=3)
            ),
            "call_id": ODD,
        },
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    items=st.one_of(ODD, st.lists(ITEM, max_size=8)), form=st.sampled_from(["chat", "messages", "responses"])
)
def test_the_historys_ids_are_what_reading_item_by_item_finds(items: Any, form: str) -> None:
    body = {"input" if form == "responses" else "messages": items}
    assert history_ids(body, form) == ids_one_by_one(body, form)


def test_the_ids_remembered_from_a_history_are_bounded_whatever_it_holds() -> None:
    within = [f"call_{i}" for i in range(1000)] * 2  # repeats count once
    assert Ids(within).used == set(within)
    many = [f"call_{i}" for i in range(MAX_USED + 10)]
    assert len(Ids(many).used) == MAX_USED and len(Ids(iter(many)).used) == MAX_USED
    assert Ids(iter(within)).used == set(within)
