"""Leaked tool calls repaired in each dialect, whole and streamed: split at every position of the
marker, prose (that names a tool too) left alone event by event, incomplete calls left as text,
calls written inside the thinking, and the engine's own calls kept."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.answers.changes import Changes
from gateway.answers.codex_calls import CodexCalls, ToolNames
from gateway.answers.events import parse
from gateway.answers.tool_repair import ChatRepair, MessagesRepair, ResponsesRepair, tool_calls

from .streams import (
    ARGUMENTS,
    XML,
    chat_body,
    chat_result,
    chat_stream,
    messages_body,
    messages_result,
    messages_stream,
    relayed,
    responses_body,
    responses_result,
    responses_stream,
)

LEAD = "Let me look.\n"
TEXT = LEAD + XML
# Every cut from just before the marker to just after it, and a few in the lead and the call.
CUTS = sorted({0, 5, *range(len(LEAD) - 1, len(LEAD) + len("<tool_call>") + 2), 40, len(TEXT) - 3, len(TEXT)})


def armed(body: dict[str, Any], form: str, repair: bool = True) -> Changes:
    changes = Changes()
    tool_calls(body, changes, form, repair=repair)
    return changes


def args(call: dict[str, Any]) -> Any:
    return orjson.loads(call["function"]["arguments"])


# --- chat ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["llamacpp", "vllm"])
@pytest.mark.parametrize("cut", CUTS)
def test_a_streamed_chat_answer_with_a_leaked_call_ends_with_that_call(engine: str, cut: int) -> None:
    events = relayed(armed(chat_body(), "chat"), chat_stream([TEXT[:cut], TEXT[cut:]], engine=engine))
    choice = chat_result(events)["choices"][0]
    assert choice["message"]["content"] == LEAD
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "Bash" and args(call) == ARGUMENTS
    assert call["id"].startswith("call_") and len(call["id"]) == len("call_") + 24
    assert choice["finish_reason"] == "tool_calls"
    assert events[-1].raw == b"data: [DONE]\n\n"


def test_a_whole_chat_answer_with_a_leaked_call_comes_back_with_that_call() -> None:
    payload = {
        "id": "c",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": XML}, "finish_reason": "stop"}],
    }
    choice = armed(chat_body(), "chat").whole(payload)["choices"][0]
    assert choice["message"]["content"] is None
    assert [args(c) for c in choice["message"]["tool_calls"]] == [ARGUMENTS]
    assert choice["finish_reason"] == "tool_calls"


def test_prose_that_names_a_tool_passes_event_by_event_with_its_bytes() -> None:
    pieces = ["I would ", "call the Bash ", "tool with ls,\n", "but the answer is ", "already here."]
    blocks = chat_stream(pieces)
    changes = armed(chat_body(), "chat")
    for block in blocks:
        out = changes.stream(parse(block))
        assert [e.encode() for e in out] == [block]  # as it came, when it came
    assert changes.end() == []


@pytest.mark.parametrize(
    "text",
    [
        XML[:-20],  # cut off by the budget
        XML.replace("Bash", "Rm"),  # a tool the request did not declare
        XML.replace("command", "cmd"),  # not the tool's schema
        "Use <tool_call> tags to call tools.",
    ],
)
def test_a_chat_answer_whose_call_is_not_complete_stays_the_text_it_was(text: str) -> None:
    for cut in (0, len(text) // 2, len(text)):
        events = relayed(armed(chat_body(), "chat"), chat_stream([text[:cut], text[cut:]]))
        choice = chat_result(events)["choices"][0]
        assert choice["message"]["content"] == text
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


@pytest.mark.parametrize("engine", ["llamacpp", "vllm"])
def test_a_call_written_in_the_thinking_is_taken_when_the_answer_is_empty(engine: str) -> None:
    thinking = ["I should list the files.\n", XML[:30], XML[30:]]
    events = relayed(armed(chat_body(), "chat"), chat_stream([], engine=engine, reasoning=thinking))
    message = chat_result(events)["choices"][0]["message"]
    assert [args(c) for c in message["tool_calls"]] == [ARGUMENTS]
    field = "reasoning" if engine == "vllm" else "reasoning_content"
    assert message[field] == "".join(thinking)  # the thinking keeps its text
    whole = {"choices": [{"message": {"content": None, field: "".join(thinking)}, "finish_reason": "stop"}]}
    assert [
        args(c) for c in armed(chat_body(), "chat").whole(whole)["choices"][0]["message"]["tool_calls"]
    ] == [ARGUMENTS]


def test_a_call_weighed_in_the_thinking_is_no_call_when_the_model_answered_in_words() -> None:
    events = relayed(
        armed(chat_body(), "chat"), chat_stream(["No tool is needed: 42."], reasoning=["maybe ", XML])
    )
    choice = chat_result(events)["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


def test_repaired_calls_follow_the_engines_own_calls() -> None:
    native = {
        "index": 0,
        "id": "call_engine",
        "type": "function",
        "function": {"name": "Bash", "arguments": '{"command": "pwd"}'},
    }
    events = relayed(armed(chat_body(), "chat"), chat_stream([XML], calls=[native]))
    calls = chat_result(events)["choices"][0]["message"]["tool_calls"]
    assert [args(c) for c in calls] == [{"command": "pwd"}, ARGUMENTS]
    assert calls[0]["id"] == "call_engine" and len({c["id"] for c in calls}) == 2


def test_two_leaked_calls_get_ids_of_their_own() -> None:
    events = relayed(armed(chat_body(), "chat"), chat_stream([XML + "\n" + XML]))
    calls = chat_result(events)["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 2 and len({c["id"] for c in calls}) == 2


def test_without_the_fix_a_leaked_call_stays_text() -> None:
    events = relayed(armed(chat_body(), "chat", repair=False), chat_stream([TEXT]))
    assert chat_result(events)["choices"][0]["message"]["content"] == TEXT


def test_a_request_without_tools_keeps_the_fast_path() -> None:
    for body, form in (
        (chat_body(tools=[]), "chat"),
        (messages_body(tools=None), "messages"),
        ({"input": "x"}, "responses"),
    ):
        changes = armed(body, form)
        assert not changes and changes.items == []


def test_the_changes_go_first_so_codex_calls_sees_the_repaired_calls() -> None:
    changes = Changes([CodexCalls(ToolNames(custom={"exec"}))])
    tool_calls(responses_body(), changes, "responses", repair=True)
    assert [type(c).__name__ for c in changes.items] == ["ResponsesRepair", "ResponsesIds", "CodexCalls"]


# --- Anthropic Messages -------------------------------------------------------------------------


@pytest.mark.parametrize("cut", CUTS)
def test_a_streamed_messages_answer_with_a_leaked_call_ends_with_a_tool_use_block(cut: int) -> None:
    events = relayed(armed(messages_body(), "messages"), messages_stream([TEXT[:cut], TEXT[cut:]]))
    message = messages_result(events)
    text, tool_use = message["content"]
    assert text == {"type": "text", "text": LEAD}
    assert tool_use["type"] == "tool_use" and tool_use["name"] == "Bash" and tool_use["input"] == ARGUMENTS
    assert tool_use["id"].startswith("toolu_")
    assert message["stop_reason"] == "tool_use"
    starts = [e.data["index"] for e in events if e.data and e.data.get("type") == "content_block_start"]
    assert starts == [0, 1]


def test_a_messages_text_block_that_held_only_the_call_is_not_sent() -> None:
    events = relayed(
        armed(messages_body(), "messages"), messages_stream(["I'll", " think."], thinking=[], stop="end_turn")
    )
    assert messages_result(events)["content"] == [{"type": "text", "text": "I'll think."}]
    events = relayed(
        armed(messages_body(), "messages"), messages_stream([XML[:9], XML[9:]], thinking=["hmm"])
    )
    message = messages_result(events)
    assert [b["type"] for b in message["content"]] == ["thinking", "tool_use"]
    starts = [e.data["index"] for e in events if e.data and e.data.get("type") == "content_block_start"]
    assert starts == [0, 1]  # numbered on without a gap


def test_a_whole_messages_answer_with_a_leaked_call_comes_back_with_a_tool_use_block() -> None:
    payload = {"type": "message", "content": [{"type": "text", "text": TEXT}], "stop_reason": "end_turn"}
    fixed = armed(messages_body(), "messages").whole(payload)
    assert [b["type"] for b in fixed["content"]] == ["text", "tool_use"]
    assert fixed["content"][0]["text"] == LEAD and fixed["content"][1]["input"] == ARGUMENTS
    assert fixed["stop_reason"] == "tool_use"


def test_a_messages_call_in_the_thinking_is_taken_when_the_answer_is_empty() -> None:
    events = relayed(armed(messages_body(), "messages"), messages_stream([], thinking=["so:\n", XML]))
    message = messages_result(events)
    assert [b["type"] for b in message["content"]] == ["thinking", "tool_use"]
    assert message["content"][1]["input"] == ARGUMENTS and message["stop_reason"] == "tool_use"


def test_messages_prose_keeps_its_bytes() -> None:
    blocks = messages_stream(["Use the ", "Bash tool", " yourself."])
    changes = armed(messages_body(), "messages")
    out = [e.encode() for block in blocks for e in changes.stream(parse(block))]
    assert out == blocks


# --- Responses ----------------------------------------------------------------------------------


def numbers(events: list[Any], key: str) -> list[int]:
    return [e.data[key] for e in events if e.data and isinstance(e.data.get(key), int)]


@pytest.mark.parametrize("cut", CUTS)
def test_a_streamed_responses_answer_with_a_leaked_call_ends_with_a_function_call_item(cut: int) -> None:
    events = relayed(
        armed(responses_body(), "responses"), responses_stream([TEXT[:cut], TEXT[cut:]], reasoning=["ok"])
    )
    response = responses_result(events)
    kinds = [i["type"] for i in response["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    assert response["output"][1]["content"][0]["text"] == LEAD
    call = response["output"][2]
    assert call["name"] == "Bash" and orjson.loads(call["arguments"]) == ARGUMENTS
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    sequence = numbers(events, "sequence_number")
    assert sequence == list(range(len(sequence)))
    added = [
        e.data["output_index"] for e in events if e.data and e.data["type"] == "response.output_item.added"
    ]
    assert added == [0, 1, 2]
    done = [e.data["item"] for e in events if e.data and e.data["type"] == "response.output_item.done"]
    assert done == response["output"]  # what the client was sent, and the final response, agree


def test_a_responses_message_that_held_only_the_call_is_not_sent() -> None:
    events = relayed(armed(responses_body(), "responses"), responses_stream([XML[:12], XML[12:]]))
    response = responses_result(events)
    assert [i["type"] for i in response["output"]] == ["function_call"]
    assert [e.data["output_index"] for e in events if e.data and "output_index" in e.data] == [0, 0, 0, 0]


def test_a_whole_responses_answer_with_a_leaked_call_comes_back_with_a_function_call_item() -> None:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": XML}]}
    fixed = armed(responses_body(), "responses").whole({"output": [message], "status": "completed"})
    assert [i["type"] for i in fixed["output"]] == ["function_call"]
    assert orjson.loads(fixed["output"][0]["arguments"]) == ARGUMENTS


def test_a_responses_call_in_the_reasoning_is_taken_when_the_answer_is_empty() -> None:
    events = relayed(armed(responses_body(), "responses"), responses_stream([], reasoning=["first ", XML]))
    assert [i["type"] for i in responses_result(events)["output"]] == ["reasoning", "function_call"]
    reasoning = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": XML}]}
    fixed = armed(responses_body(), "responses").whole({"output": [reasoning]})
    assert [i["type"] for i in fixed["output"]] == ["reasoning", "function_call"]


def test_a_repaired_call_of_codexs_custom_tool_reaches_codex_as_a_custom_call() -> None:
    schema = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    body = {"input": "x", "tools": [{"type": "function", "name": "exec", "parameters": schema}]}
    changes = Changes([CodexCalls(ToolNames(custom={"exec"}))])
    tool_calls(body, changes, "responses", repair=True)
    leaked = "<tool_call>\n<function=exec>\n<parameter=input>\nconsole.log(1)\n</parameter>\n</function>\n</tool_call>"
    events = relayed(changes, responses_stream([leaked]))
    [item] = responses_result(events)["output"]
    assert item["type"] == "custom_tool_call" and item["name"] == "exec" and item["input"] == "console.log(1)"


def test_responses_prose_keeps_its_bytes() -> None:
    blocks = responses_stream(["Run ", "Bash", " yourself."])
    changes = armed(responses_body(), "responses")
    out = [e.encode() for block in blocks for e in changes.stream(parse(block))]
    assert out == blocks


def test_each_repair_counts_what_it_repaired() -> None:
    repair = ChatRepair.__name__, MessagesRepair.__name__, ResponsesRepair.__name__
    changes = armed(chat_body(), "chat")
    relayed(changes, chat_stream([XML]))
    assert type(changes.items[0]).__name__ in repair and changes.items[0].repaired == 1  # type: ignore[attr-defined]


def test_a_messages_text_block_whose_start_carries_text_keeps_it_once() -> None:
    blocks = messages_stream(["there."])
    start = parse(blocks[1])[0]
    assert start.data is not None and start.data["type"] == "content_block_start"
    start.data["content_block"]["text"] = "Hello "
    blocks[1] = start.changed().encode()
    events = relayed(armed(messages_body(), "messages"), blocks)
    assert messages_result(events)["content"] == [{"type": "text", "text": "Hello there."}]
