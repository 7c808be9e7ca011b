from typing import Any

import pytest

from gateway.dialects.answer import Answer
from gateway.dialects.openai import OPENAI


def test_vllm_usage_with_prompt_details() -> None:
    answer = Answer()
    OPENAI.read_whole(
        answer,
        {
            "choices": [{"message": {"content": "hi", "reasoning": None}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 8},
            },
        },
    )
    assert (answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens) == (10, 2, 8)
    assert answer.content_seen and not answer.thinking_trap


def test_llamacpp_timings_give_cached_tokens_when_usage_has_none() -> None:
    answer = Answer()
    OPENAI.read_whole(answer, {"choices": [], "usage": {"prompt_tokens": 5}, "timings": {"cache_n": 3}})
    assert answer.cached_tokens == 3


@pytest.mark.parametrize(
    ("message", "finish", "trap"),
    [
        ({"content": "", "reasoning_content": "thinking..."}, "length", True),
        ({"content": None, "reasoning": "thinking..."}, "length", True),
        ({"content": "answer", "reasoning": "thinking..."}, "length", False),
        ({"content": "", "reasoning": "thinking..."}, "stop", False),
        ({"content": ""}, "length", False),
        ({"content": None, "tool_calls": [{"id": "1"}]}, "length", False),
    ],
)
def test_thinking_trap(message: dict[str, object], finish: str, trap: bool) -> None:
    answer = Answer()
    OPENAI.read_whole(answer, {"choices": [{"message": message, "finish_reason": finish}]})
    assert answer.thinking_trap is trap


def test_reasoning_tokens_alone_count_for_the_trap() -> None:
    answer = Answer()
    OPENAI.read_whole(
        answer,
        {
            "choices": [{"message": {"content": ""}, "finish_reason": "length"}],
            "usage": {"completion_tokens": 200, "completion_tokens_details": {"reasoning_tokens": 200}},
        },
    )
    assert answer.thinking_trap


def test_garbage_is_ignored() -> None:
    answer = Answer()
    OPENAI.read_whole(answer, {"choices": "x", "usage": {"prompt_tokens": "many"}})
    OPENAI.read_event(answer, {"choices": [1, {"delta": "x"}]})
    assert answer.prompt_tokens is None and not answer.content_seen


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([{"role": "user", "content": "look at image_url please"}], False),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], False),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}}]}], True),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], True),
        (["not a dict", {"role": "user", "content": None}], False),
    ],
)
def test_images_are_found_structurally(messages: list[Any], expected: bool) -> None:
    assert OPENAI.has_images({"messages": messages}) is expected
