"""gateway/pipeline/walk.py: one walk over a parsed body gives its depth, whether it may hold an
integer beyond 64 bits, and its prompt's token estimate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dialects.openai import IMAGE_PART_TYPES
from gateway.dialects.registry import BY_NAME
from gateway.dialects.tool_results import tool_images
from gateway.errors import BadRequest
from gateway.pipeline.rewrite import check_request
from gateway.pipeline.walk import PROMPT_KEYS, SKIP_KEYS, KnownTools, walk

FIXTURES = Path(__file__).parent.parent / "fixtures" / "agents"
# Every captured agent request (the models listing is not one).
CAPTURED = pytest.mark.parametrize(
    "path",
    sorted(p for p in FIXTURES.glob("*.json") if p.stem != "codex-models-request"),
    ids=lambda p: p.stem,
)


def estimate_tokens(body: dict[str, Any]) -> int:
    return walk(body, 64).estimated_tokens


# --- the estimate (the rule, case by case) -----------------------------------------------------


def test_the_estimate_is_four_characters_a_token_rounded_down() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 399}]}
    # "user" and the content both count: 4 + 399 = 403 characters.
    assert estimate_tokens(body) == 403 // 4


def test_the_estimate_adds_up_every_prompt_key_of_the_three_dialects() -> None:
    ten = "y" * 40
    body = {
        "messages": [{"content": ten}],
        "system": ten,
        "prompt": ten,
        "input": [{"content": [{"text": ten}]}],
        "instructions": ten,
        "tools": [{"description": ten}],
        "functions": [{"description": ten}],
    }
    assert estimate_tokens(body) == 7 * 10


def test_the_estimate_ignores_keys_that_are_not_prompt_text() -> None:
    body = {
        "model": "m" * 400,
        "temperature": 0.5,
        "metadata": {"note": "n" * 400},
        "messages": [{"content": "abcd"}],
    }
    assert estimate_tokens(body) == 1


def test_image_and_file_data_do_not_count_as_prompt_text() -> None:
    picture = "A" * 40_000
    body = {
        "messages": [
            {
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + picture}},
                    {"type": "image", "source": {"data": picture}},
                    {"type": "input_image", "image": picture, "file_data": picture, "data": picture},
                ]
            }
        ]
    }
    # Only the short "type" values remain: image_url, image, input_image.
    assert estimate_tokens(body) == len("image_urlimageinput_image") // 4


@pytest.mark.parametrize("key", ["image_url", "url", "data", "image", "input_image", "file_data", "source"])
def test_each_key_that_holds_image_or_file_data_is_skipped_whatever_it_holds(key: str) -> None:
    body = {"messages": [{"content": [{key: "B" * 4000}, {key: {"text": "C" * 4000}}]}]}
    assert estimate_tokens(body) == 0


def test_numbers_booleans_and_nulls_in_the_prompt_count_nothing() -> None:
    body = {"messages": [{"content": None, "n": 12345678, "flag": True, "text": "abcdefgh"}]}
    assert estimate_tokens(body) == 2


def test_a_body_without_prompt_keys_estimates_zero() -> None:
    assert estimate_tokens({}) == 0
    assert estimate_tokens({"model": "dense", "max_tokens": 10}) == 0


# --- the walk against the rule written out plainly ---------------------------------------------


def prompt_chars(value: Any, counted: bool) -> int:
    """The estimate's rule, recursive and plain: strings under a prompt key count, except under a
    key that holds image or file data."""
    if isinstance(value, str):
        return len(value) if counted else 0
    if isinstance(value, list):
        return sum(prompt_chars(child, counted) for child in value)
    if isinstance(value, dict):
        return sum(prompt_chars(child, counted and key not in SKIP_KEYS) for key, child in value.items())
    return 0


def depth_of(value: Any) -> int:
    if isinstance(value, dict | list):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max((depth_of(child) for child in children), default=0)
    return 0


def rule(body: dict[str, Any]) -> int:
    return sum(prompt_chars(value, True) for key, value in body.items() if key in PROMPT_KEYS)


@CAPTURED
def test_the_walk_counts_a_captured_agent_request_as_the_rule_does(path: Path) -> None:
    captured = json.loads(path.read_text())
    body = captured.get("body", captured)
    facts = walk(body, 64)
    assert not facts.too_deep and not facts.big_float
    assert facts.prompt_chars == rule(body) > 10_000


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from([*PROMPT_KEYS, *SKIP_KEYS, "role", "x"]), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*PROMPT_KEYS, "model", "metadata"]), JSON, max_size=5))
def test_the_walk_agrees_with_the_rule_and_the_depth_on_any_body(body: dict[str, Any]) -> None:
    body = orjson.loads(orjson.dumps(body))  # the exact types a parser makes
    depth = depth_of(body)
    assert walk(body, 64).prompt_chars == rule(body)
    assert walk(body, depth).too_deep is False
    if depth >= 2:  # the limit is never below 2 (settings)
        assert walk(body, depth - 1).too_deep is True


@pytest.mark.parametrize(
    ("value", "big"),
    [(1.5, False), (9.2e18, False), (2.0**63, True), (-(2.0**63), True), (1e30, True), (2**64 - 1, False)],
)
def test_a_float_as_large_as_an_integer_past_64_bits_is_noticed_at_any_depth(value: Any, big: bool) -> None:
    body = {"tools": [{"parameters": {"default": value}}], "n": 1}
    assert walk(body, 64).big_float is big
    assert walk({"top": value}, 64).big_float is big


@pytest.mark.parametrize(
    ("numbers", "big"),
    [
        ([7] * 5000, False),  # token ids
        ([0.25, -1.5] * 2000, False),  # a vector
        ([1, 2.5, True] * 100 + [2.0**63], True),
        ([1] * 100 + [-(2.0**64)], True),
        ([1] * 100 + [2**64 - 1], False),  # an integer within 64 bits, as orjson holds it: no float
        ([1] * 100 + [2**64 - 1, 0.5], True),  # beside a float it makes body.py look at the digits
    ],
)
def test_a_long_list_of_numbers_is_read_by_its_types_and_its_largest(numbers: list[Any], big: bool) -> None:
    for body in ({"input": numbers}, {"metadata": {"v": numbers}}):
        facts = walk(body, 64)
        assert facts.big_float is big and facts.prompt_chars == 0 and not facts.too_deep


@pytest.mark.parametrize(
    "tail",
    [["word"], [{"text": "word"}], [["word"]], [None, 2.0**63], [None, "word"]],
    ids=["string", "dict", "list", "null and a large float", "null and a string"],
)
def test_a_long_list_that_is_not_only_numbers_is_walked_element_by_element(tail: list[Any]) -> None:
    body = {"messages": [1.5] * 100 + tail, "metadata": [[0] * 100 + tail]}
    facts = walk(body, 64)
    assert facts.prompt_chars == rule(body)
    assert facts.big_float is any(type(v) is float and abs(v) >= 2.0**63 for v in tail)
    assert walk(body, depth_of(body) - 1).too_deep


# --- tool lists read before ------------------------------------------------------------------------


def agreed(body: dict[str, Any], max_depth: int, known: KnownTools) -> None:
    """The walk with the known tool lists says what the plain walk says: whether too deep always,
    the rest when it is not (a body too deep is refused whatever else the walk found)."""
    plain, remembered = walk(body, max_depth), walk(body, max_depth, known)
    assert remembered.too_deep is plain.too_deep
    if not plain.too_deep:
        assert remembered[:3] == plain[:3] and remembered.image_parts is plain.image_parts
    if remembered.tools_json is not None:  # the list's own JSON, of the very list in the body
        assert remembered.tools_json.of(body["tools"]) == orjson.dumps(body["tools"])
        assert remembered.tools_json.of(list(body["tools"])) is None


@CAPTURED
def test_a_captured_agent_request_walked_with_its_tools_known_says_what_the_walk_says(path: Path) -> None:
    captured = json.loads(path.read_text())
    raw = orjson.dumps(captured.get("body", captured))
    known = KnownTools()
    depth = depth_of(orjson.loads(raw))
    for limit in (64, depth, depth - 1):
        for _ in range(2):  # the second time from what the first remembered, on a body parsed again
            agreed(orjson.loads(raw), limit, known)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from([*PROMPT_KEYS, "model", "metadata"]), JSON, max_size=5),
    st.lists(JSON, min_size=1, max_size=4),
)
def test_any_body_walked_with_its_tools_known_says_what_the_walk_says(
    body: dict[str, Any], tools: list[Any]
) -> None:
    body = orjson.loads(orjson.dumps({**body, "tools": tools}))  # the exact types a parser makes
    known = KnownTools()
    depth = depth_of(body)
    for limit in {64, depth, max(2, depth - 1)}:
        agreed(body, limit, known)
        agreed(orjson.loads(orjson.dumps(body)), limit, known)


def test_a_tool_list_is_remembered_once_and_another_beside_it() -> None:
    known = KnownTools()
    first = {"messages": [{"content": "hi"}], "tools": [{"name": "read", "description": "d" * 400}]}
    for _ in range(3):
        walk(orjson.loads(orjson.dumps(first)), 64, known)
    assert len(known) == 1
    walk({**first, "tools": [{"name": "write", "description": "e" * 400}]}, 64, known)
    assert len(known) == 2


def test_the_known_lists_are_bounded() -> None:
    known = KnownTools(size=3)
    for index in range(10):
        walk({"tools": [{"name": f"tool{index}"}]}, 64, known)
    assert len(known) == 3


def test_a_tool_list_deeper_than_orjson_writes_is_walked_and_not_remembered() -> None:
    deep: Any = "leaf"
    for _ in range(300):  # orjson writes at most 254 levels
        deep = [deep]
    body = {"tools": [deep]}
    known = KnownTools()
    assert walk(body, 1000, known) == walk(body, 1000)
    assert walk(body, 64, known).too_deep and len(known) == 0


# --- image parts: whether the scans for them can find one -------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"messages": [{"role": "user", "content": "look at image_url please"}]}, False),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "image"}]}]}, False),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
            True,
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, True),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}]}, True),
        (  # an image inside a Messages tool result
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "content": [{"type": "image", "source": {}}]}],
                    }
                ]
            },
            True,
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}], "metadata": {"type": "image"}},
            False,
        ),
    ],
)
def test_the_walk_says_whether_a_part_names_an_image_type(body: dict[str, Any], expected: bool) -> None:
    assert walk(body, 64).image_parts is expected


TYPES = st.sampled_from(
    [*sorted(IMAGE_PART_TYPES), "text", "input_text", "tool_result", "tool_use", "function_call_output"]
)
PART = st.recursive(
    st.fixed_dictionaries(
        {"type": TYPES},
        optional={
            "text": st.just("image"),
            "image_url": st.just({"url": "data:image/png;base64,AA"}) | st.just("u"),
            "source": st.just({"type": "base64", "media_type": "image/png", "data": "AA"}),
        },
    ),
    lambda inner: st.fixed_dictionaries(
        {"type": TYPES},
        optional={"content": st.lists(inner, max_size=3), "output": st.lists(inner, max_size=3)},
    ),
    max_leaves=8,
)
ITEM = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system"])},
    optional={
        "type": TYPES,
        "content": st.text(max_size=3) | st.lists(PART, max_size=3),
        "output": st.lists(PART),
    },
)


@settings(max_examples=400, deadline=None)
@given(st.lists(ITEM, max_size=5), st.lists(ITEM, max_size=5), st.booleans())
def test_where_the_walk_saw_no_image_part_no_scan_finds_one(
    messages: list[Any], items: list[Any], tools: bool
) -> None:
    """Routing and the tool-result image step skip their scans where the walk saw no image part:
    in such a body, no dialect's scan and no tool-result scan finds one."""
    body: dict[str, Any] = {"messages": messages, "input": items}
    if tools:
        body["tools"] = [{"name": "read", "input_schema": {"type": "object"}}]
    body = orjson.loads(orjson.dumps(body))
    found = [BY_NAME[name].dialect.has_images(body) for name in ("chat", "messages", "responses")]
    found.append(bool(tool_images(body)))
    for facts in (walk(body, 64), walk(body, 64, KnownTools())):
        assert facts.image_parts or not any(found)


# --- part types: whether the dialects' check of them can refuse one ---------------------------------

ODD_TYPE = st.one_of(
    st.none(), st.integers(-(2**31), 2**31), st.booleans(), st.lists(st.text(max_size=2), max_size=2)
)
TYPED = st.recursive(
    st.fixed_dictionaries({}, optional={"type": TYPES | ODD_TYPE, "text": st.text(max_size=2)}),
    lambda inner: st.fixed_dictionaries(
        {}, optional={"type": TYPES | ODD_TYPE, "content": st.lists(inner, max_size=3), "input": inner}
    ),
    max_leaves=8,
)
TURN = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"])}, optional={"content": st.lists(TYPED, max_size=3)}
)


def refusal(body: dict[str, Any], endpoint: str, odd_types: bool) -> str | None:
    try:
        check_request(body, endpoint, odd_types)
    except BadRequest as error:
        return error.param
    return None


@settings(max_examples=400, deadline=None)
@given(st.lists(TURN, min_size=1, max_size=4), st.sampled_from(["chat", "messages", "responses"]))
def test_a_body_is_refused_for_a_part_type_whatever_the_walk_let_the_check_skip(
    turns: list[Any], endpoint: str
) -> None:
    """Each dialect's check reads every part's type only where the walk saw a `type` that is
    neither a string nor null; the refusal, and the place it names, are the same either way."""
    body = orjson.loads(orjson.dumps({"input" if endpoint == "responses" else "messages": turns}))
    facts = walk(body, 64)
    assert refusal(body, endpoint, facts.odd_types) == refusal(body, endpoint, True)


def test_a_part_whose_type_is_not_a_string_is_seen_by_the_walk() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text"}, {"type": ["image"]}]}]}
    assert walk(body, 64).odd_types and not walk({"messages": [{"content": [{"type": None}]}]}, 64).odd_types
    assert refusal(body, "messages", walk(body, 64).odd_types) == "messages[0].content[1].type"
