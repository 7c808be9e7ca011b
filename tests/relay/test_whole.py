"""Whole answers: a large one is sent as it came, its usage read from its end without parsing it
whole; the usage reader copes with strings that hold braces and quotes."""

from __future__ import annotations

import orjson
import pytest

from gateway.relay.whole import _tail_usage


def test_the_usage_is_read_from_the_end_of_a_large_answer() -> None:
    data = [{"embedding": [0.125] * 1000, "index": i} for i in range(200)]
    answer = orjson.dumps({"data": data, "usage": {"prompt_tokens": 7, "total_tokens": 7}})
    assert _tail_usage(answer) == {"usage": {"prompt_tokens": 7, "total_tokens": 7}}


@pytest.mark.parametrize("text", ["a } b", 'quote \\" and { brace', "back\\\\slash }"])
def test_strings_inside_the_usage_do_not_end_it(text: str) -> None:
    answer = b'{"x": 1, "usage": {"note": "' + text.encode() + b'", "prompt_tokens": 3}}'
    usage = _tail_usage(answer)
    assert usage is not None and usage["usage"]["prompt_tokens"] == 3


def test_an_answer_without_usage_gives_none() -> None:
    assert _tail_usage(b'{"data": [1, 2, 3]}') is None
