import copy
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.pipeline.prefix import ChurnTracker, VolatileCache, apply, find_volatile, fingerprint


@pytest.mark.parametrize(
    ("text", "value", "kind"),
    [
        ("Current time: 2026-12-02T11:28:12Z.", "2026-12-02T11:28:12Z", "timestamp"),
        ("now 2026-12-02 11:28:12.123+01:00 ok", "2026-12-02 11:28:12.123+01:00", "timestamp"),
        ("Date: Wed, 02 Dec 2026 11:28:12 +0000", "Wed, 02 Dec 2026 11:28:12 +0000", "timestamp"),
        ("built Wed Dec  2 11:28:12 UTC 2026 here", "Wed Dec  2 11:28:12 UTC 2026", "timestamp"),
        ("at 12/02/2026 11:28 AM sharp", "12/02/2026 11:28 AM", "timestamp"),
        ("on December 2, 2026 at 11:28 PM", "December 2, 2026 at 11:28 PM", "timestamp"),
        ("Today is 2026-12-02.", "2026-12-02", "date"),
        ("Today is December 2, 2026.", "December 2, 2026", "date"),
        ("Today is Wednesday, 2 December 2026", "Wednesday, 2 December 2026", "date"),
        ("Heute ist 02.12.2026", "02.12.2026", "date"),
        ("clock 11:28:12 now", "11:28:12", "time"),
        ("timestamp=1796212885", "1796212885", "epoch"),
        ("ts: 1796212885123", "1796212885123", "epoch"),
        ("request 3fa85f64-5717-4562-b3fc-2c963f66afa6", "3fa85f64-5717-4562-b3fc-2c963f66afa6", "uuid"),
        ("trace 9f86d081884c7d659a2feaa0c55ad015", "9f86d081884c7d659a2feaa0c55ad015", "hex"),
        ("nonce=Zx8Qm3Lp9Rt2Vw7Yk4Nb6Hc1", "Zx8Qm3Lp9Rt2Vw7Yk4Nb6Hc1", "nonce"),
    ],
)
def test_volatile_content_is_found(text: str, value: str, kind: str) -> None:
    spans = find_volatile(text)
    assert [(text[s.start : s.end], s.kind) for s in spans] == [(value, kind)]


@pytest.mark.parametrize(
    "text",
    [
        "Python 3.11.7 and vLLM 0.32.0",
        "version v1.2.3-rc1, build 20261202",
        "listen on 127.0.0.1:8080, port 18000",
        "see line 1234, column 56, and 12:30 is lunch",
        "call 5551234567 for support",  # ten digits with no time word nearby
        "the ratio is 3/4 and 1/2",
        "useCamelCaseIdentifierNamesForEverything",
        "path /usr/local/lib/python3.11/site-packages",
        "deadbeef cafe 0xff",
        "a sha256 sum: not here",
        "Respond in JSON with keys id, name and created_at.",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert find_volatile(text) == []


def body_with(system: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "answer"},
            {"role": "user", "content": "second"},
        ],
        **extra,
    }


SYSTEM = "You are a coding agent.\nCurrent time: 2026-12-02T11:28:12Z\nRequest id: 3fa85f64-5717-4562-b3fc-2c963f66afa6\nBe terse."


def test_warn_forwards_unchanged_and_names_what_it_found() -> None:
    body = body_with(SYSTEM)
    before = copy.deepcopy(body)
    report = apply(body, "warn", "p", VolatileCache(), None)
    assert body == before
    assert report.kinds == ["timestamp", "uuid"] and report.moved == []


def test_move_takes_the_spans_out_of_the_system_prompt_into_the_last_user_message() -> None:
    body = body_with(SYSTEM)
    report = apply(body, "move", "p", VolatileCache(), None)
    messages = body["messages"]
    assert messages[0]["content"] == "You are a coding agent.\nBe terse."
    assert messages[0]["role"] == "system" and messages[-1]["role"] == "user"  # no trailing system message
    assert messages[-1]["content"] == (
        "second\n\n[Current time: 2026-12-02T11:28:12Z; Request id: 3fa85f64-5717-4562-b3fc-2c963f66afa6]"
    )
    assert messages[1]["content"] == "first"  # earlier turns untouched
    assert report.moved and report.kinds == ["timestamp", "uuid"]


def test_move_makes_the_prefix_identical_across_requests() -> None:
    first, second = (
        body_with(SYSTEM),
        body_with(SYSTEM.replace("11:28:12", "11:29:47").replace("3fa85f64", "0bb1c2d3")),
    )
    cache = VolatileCache()
    a = apply(first, "move", "p", cache, None)
    b = apply(second, "move", "p", cache, None)
    assert orjson.dumps(first["messages"][:3]) == orjson.dumps(second["messages"][:3])
    assert a.fingerprint == b.fingerprint


def test_without_move_the_fingerprint_changes_with_the_timestamp() -> None:
    a = apply(body_with(SYSTEM), "warn", "p", VolatileCache(), None)
    b = apply(body_with(SYSTEM.replace("11:28:12", "11:29:47")), "warn", "p", VolatileCache(), None)
    assert a.fingerprint != b.fingerprint


def test_strip_removes_the_spans() -> None:
    body = body_with(SYSTEM)
    apply(body, "strip", "p", VolatileCache(), None)
    assert body["messages"][0]["content"] == "You are a coding agent.\nBe terse."
    assert body["messages"][-1]["content"] == "second"


def test_move_works_on_content_parts_and_only_on_the_leading_system_block() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Now: 2026-12-02 10:00:00"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
            },
            {"role": "system", "content": "late note 2026-12-02 10:00:00"},
        ]
    }
    apply(body, "move", "p", VolatileCache(), None)
    assert body["messages"][0]["content"] == [{"type": "text", "text": ""}]
    assert body["messages"][1]["content"][-1] == {"type": "text", "text": "[Now: 2026-12-02 10:00:00]"}
    assert body["messages"][2]["content"] == "late note 2026-12-02 10:00:00"


def test_move_without_a_user_message_only_reports() -> None:
    body = {"messages": [{"role": "system", "content": SYSTEM}]}
    report = apply(body, "move", "p", VolatileCache(), None)
    assert body["messages"][0]["content"] == SYSTEM and report.kinds


def test_off_detects_nothing_but_still_fingerprints() -> None:
    body = body_with(SYSTEM)
    report = apply(body, "off", "p", VolatileCache(), None)
    assert report.kinds == [] and len(report.fingerprint) == 12


def test_fingerprint_covers_preset_system_and_tools() -> None:
    system = [{"role": "system", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": 1, "b": 2}}}]
    base = fingerprint("p", system, tools)
    assert base == fingerprint("p", system, tools, orjson.dumps(tools))  # the walk's JSON of them
    assert base == fingerprint("p", system, copy.deepcopy(tools))
    assert base != fingerprint("q", system, tools)
    assert base != fingerprint("p", [{"role": "system", "content": "y"}], tools)
    reordered = [{"type": "function", "function": {"name": "f", "parameters": {"b": 2, "a": 1}}}]
    assert base != fingerprint("p", system, reordered)  # key order changes the rendered prompt


def test_the_affinity_key_is_stable_as_a_conversation_grows() -> None:
    turn1 = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]}
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ]
    }
    other = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "another"}]}
    key = apply(turn1, "off", "p", VolatileCache(), None).affinity_key
    assert key == apply(turn2, "off", "p", VolatileCache(), None).affinity_key
    assert key != apply(other, "off", "p", VolatileCache(), None).affinity_key
    assert apply(turn1, "off", "p", VolatileCache(), "session-7").affinity_key == "session-7"


def test_churn_tracker() -> None:
    tracker = ChurnTracker(size=2)
    assert not tracker.observe("c1", "p", "f1")
    assert not tracker.observe("c1", "p", "f1")
    assert tracker.observe("c1", "p", "f2")
    assert not tracker.observe("c2", "p", "f9")
    assert tracker.first_report("c1", "f2") and not tracker.first_report("c1", "f2")


def test_the_detection_cache_is_bounded() -> None:
    cache = VolatileCache(size=3)
    for i in range(10):
        cache.spans(f"text {i} at 2026-12-02T10:00:0{i % 10}Z")
    assert len(cache._entries) == 3


text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=30)})
content = st.text(max_size=60) | st.lists(text_part, min_size=1, max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": content}
)
volatile_bits = st.sampled_from(
    ["", " 2026-12-02T11:28:12Z", " id 3fa85f64-5717-4562-b3fc-2c963f66afa6", " ts=1796212885"]
)


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(message, min_size=1, max_size=6),
    extra=volatile_bits,
    mode=st.sampled_from(["off", "warn", "move", "strip"]),
)
def test_only_leading_system_text_and_the_last_user_message_can_change(
    messages: list[dict[str, Any]], extra: str, mode: str
) -> None:
    if isinstance(messages[0]["content"], str):
        messages[0] = {**messages[0], "content": messages[0]["content"] + extra}
    tools = [{"type": "function", "function": {"name": "t", "parameters": {"z": 1, "a": 2}}}]
    body = {"messages": copy.deepcopy(messages), "tools": copy.deepcopy(tools)}
    apply(body, mode, "p", VolatileCache(), None)
    assert orjson.dumps(body["tools"]) == orjson.dumps(tools)
    out = body["messages"]
    assert len(out) == len(messages) and [m["role"] for m in out] == [m["role"] for m in messages]
    leading = 0
    while leading < len(messages) and messages[leading]["role"] in ("system", "developer"):
        leading += 1
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    last_user = users[-1] if users else None
    for index, (before, after) in enumerate(zip(messages, out, strict=True)):
        if mode in ("off", "warn") or (index >= leading and index != last_user):
            assert orjson.dumps(after) == orjson.dumps(before), index


def test_the_affinity_key_ignores_what_move_appends() -> None:
    def turn(stamp: str, turns: int) -> dict[str, Any]:
        messages = [
            {"role": "system", "content": f"Now: 2026-12-02T10:00:{stamp}Z\nrules"},
            {"role": "user", "content": "q1"},
        ]
        for i in range(1, turns):
            messages += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"q{i + 1}"}]
        return {"messages": messages}

    keys = {apply(turn(f"0{n}", n), "move", "p", VolatileCache(), None).affinity_key for n in range(1, 5)}
    assert len(keys) == 1
