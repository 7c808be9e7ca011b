"""A stream the gateway opened itself, spliced onto the replica's: the replica's opening events are
dropped, and the prompt's cache figures only its `message_start` held reach the client anyway."""

import orjson

from gateway.answers.changes import Changes
from gateway.answers.events import encode, parse
from gateway.answers.splice import Splice

MESSAGES_OPENING = frozenset({"message_start", "ping"})


def _event(kind: str, data: dict[str, object]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


START = _event(
    "message_start",
    {
        "message": {
            "id": "msg_1",
            "usage": {"input_tokens": 12, "cache_read_input_tokens": 30000, "output_tokens": 1},
        }
    },
)
BLOCK = _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
DELTA = _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}})
MESSAGE_DELTA = _event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}})
STOP = _event("message_stop", {})


def _through(changes: Changes, *blocks: bytes) -> list[dict[str, object]]:
    out = b""
    for block in blocks:
        out += encode(changes.stream(parse(block))) if changes.wants(block) else block
    return [event.data for event in parse(out) if event.data is not None]


def test_the_replicas_opening_is_dropped_and_its_cache_figures_come_with_the_message_delta() -> None:
    changes = Changes([Splice(MESSAGES_OPENING)])
    events = _through(changes, START, BLOCK, DELTA, MESSAGE_DELTA, STOP)
    assert [e["type"] for e in events] == [
        "content_block_start",
        "content_block_delta",
        "message_delta",
        "message_stop",
    ]
    assert events[2]["usage"] == {"output_tokens": 5, "input_tokens": 12, "cache_read_input_tokens": 30000}


def test_between_the_opening_and_the_message_delta_no_block_is_parsed() -> None:
    changes = Changes([Splice(MESSAGES_OPENING)])
    _through(changes, START, BLOCK)
    assert not changes.wants(DELTA)
    assert changes.wants(MESSAGE_DELTA)
    _through(changes, MESSAGE_DELTA)
    assert not changes.wants(MESSAGE_DELTA + STOP)  # done: the rest passes as bytes


def test_figures_the_message_delta_reports_itself_are_kept() -> None:
    own = _event("message_delta", {"delta": {}, "usage": {"output_tokens": 5, "cache_read_input_tokens": 7}})
    events = _through(Changes([Splice(MESSAGES_OPENING)]), START, BLOCK, own)
    assert events[-1]["usage"] == {"output_tokens": 5, "cache_read_input_tokens": 7, "input_tokens": 12}


def test_an_opening_without_figures_leaves_the_rest_of_the_stream_unparsed() -> None:
    created = b'event: response.created\ndata: {"type":"response.created","response":{"id":"r1"}}\n\n'
    text = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    changes = Changes([Splice(frozenset({"response.created", "response.in_progress"}))])
    events = _through(changes, created, text)
    assert [e["type"] for e in events] == ["response.output_text.delta"]
    assert not changes.wants(text)
