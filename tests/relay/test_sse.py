import itertools

import orjson
import pytest

from gateway.dialects.answer import Answer
from gateway.dialects.openai import OPENAI
from gateway.relay.sse import TRAP_COMMENT, SseRelay

STREAM = (
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    b": ping\n\n"
    b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    b"data: [DONE]\n\n"
)
USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'


def relay_all(chunks: list[bytes], drop_usage: bool = False) -> tuple[bytes, SseRelay]:
    ticks = itertools.count()
    relay = SseRelay(Answer(), drop_usage=drop_usage, clock=lambda: float(next(ticks)))
    out = b"".join(relay.feed(c) for c in chunks) + relay.flush()
    return out, relay


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_any_chunking_passes_the_stream_through_byte_for_byte(size: int) -> None:
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    out, relay = relay_all(chunks)
    assert out == STREAM
    answer = relay.answer
    assert (answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens) == (7, 2, 4)
    assert answer.finish_reason == "stop" and answer.content_seen and not answer.thinking_trap


def test_the_injected_usage_chunk_is_removed_and_still_counted() -> None:
    out, relay = relay_all([STREAM], drop_usage=True)
    assert out == STREAM.replace(USAGE_EVENT, b"")
    assert relay.answer.completion_tokens == 2


def test_only_complete_events_are_released() -> None:
    relay = SseRelay(Answer(), drop_usage=False, clock=lambda: 0.0)
    assert relay.feed(b'data: {"choices":[{"del') == b""
    assert relay.pending == b'data: {"choices":[{"del'
    assert relay.feed(b'ta":{}}]}\n') == b""
    assert relay.feed(b"\ndata: x") == b'data: {"choices":[{"delta":{}}]}\n\n'
    assert relay.pending == b"data: x"


@pytest.mark.parametrize("ending", [b"\r\n\r\n", b"\r\r", b"\n\n"])
def test_every_sse_line_ending_is_a_boundary(ending: bytes) -> None:
    event = b'data: {"choices":[{"delta":{"content":"x"}}]}' + ending
    relay = SseRelay(Answer(), drop_usage=False, clock=lambda: 0.0)
    assert relay.feed(event) == event
    out, _ = relay_all([event[:-1], event[-1:]])
    assert out == event


def test_first_token_is_the_first_non_empty_content_or_reasoning() -> None:
    chunks = [
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
        b'data: {"choices":[{"delta":{"reasoning_content":"hmm"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n',
    ]
    ticks = iter([10.0, 20.0, 30.0])
    relay = SseRelay(Answer(), drop_usage=False, clock=lambda: next(ticks))
    relay.feed(chunks[0])
    assert relay.first_token_at is None
    relay.feed(chunks[1])
    assert relay.first_token_at == 10.0


def trapped(field: str) -> bytes:
    return (
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
        + b'data: {"choices":[{"delta":{"'
        + field.encode()
        + b'":"let me think"}}]}\n\n'
        + b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\n'
        + b"data: [DONE]\n\n"
    )


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_the_thinking_trap_is_seen_in_a_stream(field: str) -> None:
    _, relay = relay_all([trapped(field)])
    assert relay.answer.thinking_trap


@pytest.mark.parametrize("size", [1, 5, 64, 10_000])
def test_the_trap_comment_goes_just_before_done_once(size: int) -> None:
    """Clients stop reading at [DONE]; the comment must come before it, whatever the chunking."""
    stream = trapped("reasoning_content")
    out, relay = relay_all([stream[i : i + size] for i in range(0, len(stream), size)])
    done = stream.index(b"data: [DONE]")
    assert out == stream[:done] + TRAP_COMMENT + stream[done:]
    assert relay.warned


def test_no_trap_comment_when_an_answer_came() -> None:
    out, relay = relay_all([STREAM.replace(b'"stop"', b'"length"')])
    assert TRAP_COMMENT not in out and not relay.warned


def test_a_one_megabyte_event_in_one_byte_pieces_is_linear() -> None:
    big = b"data: " + orjson.dumps({"choices": [{"delta": {"content": "x" * 1_000_000}}]}) + b"\n\n"
    relay = SseRelay(Answer(), drop_usage=False, clock=lambda: 0.0)
    out = [relay.feed(big[i : i + 1]) for i in range(len(big))]
    assert b"".join(out) == big


def reference(stream: bytes, drop_usage: bool) -> tuple[bytes, tuple[object, ...]]:
    """What the relay must do, written the plain way: split into events, parse every one that
    carries a finish reason or usage, drop the injected usage chunk."""
    import re

    answer, kept = Answer(), []
    pieces = re.split(rb"(\r\n\r\n|\n\n|\r\r)", stream)
    for index in range(0, len(pieces), 2):
        event, separator = pieces[index], (pieces[index + 1] if index + 1 < len(pieces) else b"")
        if b'"finish_reason":"' in event or b'"usage"' in event:
            data = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
            payload = orjson.loads(b"\n".join(data)) if data and data[0].startswith(b"{") else None
            if isinstance(payload, dict):
                OPENAI.read_event(answer, payload)
                if drop_usage and payload.get("choices") == [] and "usage" in payload:
                    continue
        kept.append(event + separator)
    return b"".join(kept), _counted(answer)


def _counted(answer: Answer) -> tuple[object, ...]:
    return (answer.finish_reason, answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens)


_EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}',
    b'data: {"choices":[{"index":0,"delta":{"content":"t"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}',
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}',
    b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":8}}}',
    b'data: {"usage":null,"choices":[{"index":0,"delta":{"content":"u"}}]}',
    b": keep-alive",
    b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\ndata: {"not": "json"',
    b"data: [DONE]",
]


def test_the_relay_matches_the_plain_reference_on_generated_streams() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    streams = st.lists(
        st.tuples(st.sampled_from(_EVENTS), st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r"])),
        max_size=40,
    ).map(lambda events: b"".join(event + end for event, end in events))

    @settings(max_examples=300, deadline=None)
    @given(stream=streams, cuts=st.lists(st.integers(0, 4000), max_size=8), drop=st.booleans())
    def check(stream: bytes, cuts: list[int], drop: bool) -> None:
        edges = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
        chunks = [stream[a:b] for a, b in itertools.pairwise(edges)]
        out, relay = relay_all(chunks, drop_usage=drop)
        expected, counted = reference(stream, drop)
        assert out == expected
        assert _counted(relay.answer) == counted

    check()


@pytest.mark.pure
def test_a_read_full_of_usage_events_is_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's continuous usage puts usage in every chunk; a read of 20,000 of them is parsed event
    by event without rescanning the rest of the read each time: each event is looked for from where
    the previous one ended, within its own bytes."""
    from gateway.relay import sse

    searched: list[tuple[int, int]] = []  # (where the search began, the marker's position)
    around = sse._event_around

    def counted(data: bytes, at: int, lo: int) -> tuple[int, int, int]:
        searched.append((lo, at))
        return around(data, at, lo)

    monkeypatch.setattr(sse, "_event_around", counted)
    event = _EVENTS[1] + b"\n\n"
    big = event * 20_000
    out_big, relay = relay_all([big])
    assert out_big == big and relay.answer.completion_tokens == 1
    assert len(searched) == 20_000  # one search per marked event
    starts = [lo for lo, _ in searched]
    assert starts == sorted(starts)  # never back to the start of the read
    assert max(at - lo for lo, at in searched) < len(event)  # each within its own event


def test_a_dropped_usage_chunk_after_an_extra_blank_line_leaves_only_that_line() -> None:
    """Where a blank line follows a boundary, the plain split counts it into the next event and the
    relay leaves it standing: one more empty line, which every SSE parser skips."""
    first = _EVENTS[0] + b"\n\n"
    out, relay = relay_all([first + b"\n" + _EVENTS[3] + b"\n\ndata: [DONE]\n\n"], drop_usage=True)
    assert out == first + b"\ndata: [DONE]\n\n"
    assert relay.answer.cached_tokens == 8
