import copy
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest
from gateway.pipeline.rewrite import cap_to_context, check_request, rewrite
from gateway.routing.route import requested_task
from gateway.routing.table import parse_table

TABLE = parse_table(
    """
defaults: {max_tokens: 8192, min_max_tokens: 1024}
presets:
  plain:
    served_model: served-plain
    replicas: [{name: a, url: "http://127.0.0.1:1", engine: vllm}]
  tuned:
    served_model: served-tuned
    params: {temperature: 0.6, top_p: 0.9}
    max_tokens: 32768
    replicas: [{name: b, url: "http://127.0.0.1:2", engine: vllm}]
  thinker:
    served_model: served-thinker
    thinking: true
    min_max_tokens: 0
    replicas: [{name: c, url: "http://127.0.0.1:3", engine: llamacpp}]
  deep:
    served_model: served-deep
    thinking: true
    replicas: [{name: d, url: "http://127.0.0.1:4", engine: vllm}]
routing: {default: plain}
"""
)
PLAIN, TUNED, THINKER, DEEP = (TABLE.presets[n] for n in ("plain", "tuned", "thinker", "deep"))


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "plain", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_thinking_off_is_merged_as_a_json_bool_into_the_clients_kwargs() -> None:
    body = chat(chat_template_kwargs={"custom": 1})
    plan = rewrite(body, PLAIN, "chat", want_usage=False)
    body = plan.body
    assert body["chat_template_kwargs"] == {"custom": 1, "enable_thinking": False}
    assert ("thinking_off", "thinking=off") in plan.notes


@pytest.mark.parametrize("client_value", [True, False])
def test_the_clients_own_enable_thinking_wins(client_value: bool) -> None:
    body = chat(chat_template_kwargs={"enable_thinking": client_value})
    plan = rewrite(body, PLAIN, "chat", want_usage=False)
    body = plan.body
    assert body["chat_template_kwargs"] == {"enable_thinking": client_value}
    assert not [n for n in plan.notes if n[0].startswith("thinking")]


@pytest.mark.parametrize(("text", "value"), [("false", False), ("False", False), ("true", True)])
def test_a_string_enable_thinking_becomes_a_bool(text: str, value: bool) -> None:
    # llama-server answers 400 to a string; vLLM silently treats "false" as thinking on.
    body = chat(chat_template_kwargs={"enable_thinking": text})
    plan = rewrite(body, PLAIN, "chat", want_usage=False)
    body = plan.body
    assert body["chat_template_kwargs"]["enable_thinking"] is value
    assert plan.notes[0][0] == "thinking_kwarg_fixed"


def test_reasoning_effort_counts_as_the_clients_choice() -> None:
    body = chat(reasoning_effort="low")
    body = rewrite(body, PLAIN, "chat", want_usage=False).body
    assert "chat_template_kwargs" not in body


def test_a_thinking_preset_injects_nothing() -> None:
    body = chat()
    body = rewrite(body, THINKER, "chat", want_usage=False).body
    assert "chat_template_kwargs" not in body


def test_completions_get_no_chat_template_kwargs() -> None:
    body = {"model": "plain", "prompt": "x"}
    body = rewrite(body, PLAIN, "completions", want_usage=False).body
    assert "chat_template_kwargs" not in body and body["max_tokens"] == 8192


@pytest.mark.parametrize(
    ("preset", "given_", "expected", "note"),
    [
        (PLAIN, {}, {"max_tokens": 8192}, "max_tokens=8192"),
        (TUNED, {}, {"max_tokens": 32768}, "max_tokens=32768"),
        # The floor guards a budget thinking would eat: a thinking preset raises a small budget...
        (DEEP, {"max_tokens": 200}, {"max_tokens": 1024}, "max_tokens=200->1024"),
        (DEEP, {"max_tokens": 5000}, {"max_tokens": 5000}, None),
        (
            DEEP,
            {"max_completion_tokens": 10},
            {"max_completion_tokens": 1024},
            "max_completion_tokens=10->1024",
        ),
        # ...a preset that turns thinking off leaves a classification's max_tokens=5 alone...
        (PLAIN, {"max_tokens": 5}, {"max_tokens": 5}, None),
        # ...and so does a thinking preset when the client itself turned thinking off.
        (
            DEEP,
            {"max_tokens": 5, "chat_template_kwargs": {"enable_thinking": False}},
            {"max_tokens": 5},
            None,
        ),
        (DEEP, {"max_tokens": 5, "reasoning_effort": "none"}, {"max_tokens": 5}, None),
        (
            DEEP,
            {"max_tokens": 10, "max_completion_tokens": 3000},
            {"max_tokens": 10, "max_completion_tokens": 3000},
            None,
        ),
        (THINKER, {"max_tokens": 10}, {"max_tokens": 10}, None),  # min_max_tokens 0 leaves it
    ],
)
def test_max_tokens(preset: Any, given_: dict[str, Any], expected: dict[str, int], note: str | None) -> None:
    body = chat(**given_)
    plan = rewrite(body, preset, "chat", want_usage=False)
    body = plan.body
    assert {k: body[k] for k in expected} == expected
    texts = [text for _, text in plan.notes if text.startswith("max_")]
    assert texts == ([note] if note else [])


def test_params_fill_only_absent_fields() -> None:
    body = chat(temperature=0.0)
    plan = rewrite(body, TUNED, "chat", want_usage=False)
    body = plan.body
    assert body["temperature"] == 0.0 and body["top_p"] == 0.9
    assert ("params", "params=top_p") in plan.notes


def test_model_becomes_the_served_name_and_task_is_removed() -> None:
    body = chat(task="code")
    body = rewrite(body, TUNED, "chat", want_usage=False).body
    assert body["model"] == "served-tuned" and "task" not in body


def test_stream_options_only_on_streaming_requests() -> None:
    body = chat()
    plan = rewrite(body, PLAIN, "chat", want_usage=True)
    body = plan.body
    assert "stream_options" not in body and not plan.usage_injected  # vLLM: 400 without stream
    body = chat(stream=True)
    plan = rewrite(body, PLAIN, "chat", want_usage=True)
    body = plan.body
    assert body["stream_options"] == {"include_usage": True} and plan.usage_injected
    body = chat(stream=True, stream_options={"include_usage": True})
    plan = rewrite(body, PLAIN, "chat", want_usage=True)
    body = plan.body
    assert plan.client_wants_usage and not plan.usage_injected


@pytest.mark.parametrize(
    ("context", "given_", "expected"),
    [
        (4096, {"max_tokens": 32768}, {"max_tokens": 4096}),
        (4096, {"max_tokens": 100}, {"max_tokens": 100}),
        (None, {"max_tokens": 32768}, {"max_tokens": 32768}),
        (2048, {"max_completion_tokens": 9000, "max_tokens": 9000}, {"max_completion_tokens": 2048}),
    ],
)
def test_cap_to_context(context: int | None, given_: dict[str, int], expected: dict[str, int]) -> None:
    body = chat(**given_)
    capped, note = cap_to_context(body, context)
    assert {k: capped[k] for k in expected} == expected
    assert (note is not None) == (capped is not body)
    assert body == chat(**given_)  # the original stays as it was: another replica may differ


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": 3, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "a"}, "messages"),
        ({"model": "a", "messages": []}, "messages"),
        ({"model": "a", "messages": [{}], "stream": "yes"}, "stream"),
        ({"model": "a", "messages": [{}], "max_tokens": "10"}, "max_tokens"),
        ({"model": "a", "messages": [{}], "max_tokens": 0}, "max_tokens"),
        ({"model": "a", "messages": [{}], "max_completion_tokens": True}, "max_completion_tokens"),
        ({"model": "a", "messages": [{}], "chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"model": "a", "messages": [{}], "api_base": "http://127.0.0.2:9"}, "api_base"),
        ({"model": "a", "messages": [{}], "base_url": "http://x"}, "base_url"),
        ({"model": "a", "messages": [{}], "extra_headers": {}}, "extra_headers"),
        ({"model": "a", "messages": [{}], "url": "http://x"}, "url"),
        ({"model": "a", "messages": [{}], "stream_options": 1}, "stream_options"),
    ],
)
def test_check_request_rejects_with_a_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        check_request(body, "chat")
    assert caught.value.param == param


def test_completions_need_a_prompt() -> None:
    with pytest.raises(BadRequest):
        check_request({"model": "a"}, "completions")
    check_request({"model": "a", "prompt": "x"}, "completions")


def test_task_from_body_or_header() -> None:
    assert requested_task({"task": "code"}, "bulk") == "code"
    assert requested_task({}, "bulk") == "bulk"
    assert requested_task({}, None) is None
    with pytest.raises(BadRequest):
        requested_task({"task": 1}, None)


# --- property: the gateway changes only the keys it owns -------------------------------------

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
content = st.text(max_size=40) | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), min_size=1, max_size=3
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]), "content": content},
    optional={"name": st.text(max_size=8), "extra": json_value},
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {
                "name": st.text(min_size=1, max_size=10),
                "parameters": st.dictionaries(st.text(max_size=10), json_value, max_size=6),
            },
            optional={"description": st.text(max_size=20)},
        ),
    }
)
OWNED = {
    "model",
    "task",
    "chat_template_kwargs",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "temperature",
    "top_p",
}
chat_body = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["plain", "tuned", "auto"]),
        "messages": st.lists(message, min_size=1, max_size=5),
    },
    optional={
        "tools": st.lists(tool, max_size=3),
        "stream": st.booleans(),
        "max_tokens": st.integers(1, 100_000),
        "max_completion_tokens": st.integers(1, 100_000),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "custom", "x"]), st.booleans() | st.integers(-1000, 1000)
        ),
        "temperature": st.floats(0, 2),
        "task": st.text(max_size=5),
        "user": st.text(max_size=10),
        "seed": st.integers(0, 2**31),
        "logit_bias": st.dictionaries(st.text(max_size=3), st.integers(-100, 100), max_size=3),
        "stop": st.lists(st.text(max_size=4), max_size=3),
    },
)


@settings(max_examples=300, deadline=None)
@given(body=chat_body, preset=st.sampled_from([PLAIN, TUNED, THINKER]), want_usage=st.booleans())
def test_rewrite_changes_only_the_keys_the_gateway_owns(
    body: dict[str, Any], preset: Any, want_usage: bool
) -> None:
    original = copy.deepcopy(body)
    check_request(body, "chat")
    sent = orjson.dumps(body)
    plan = rewrite(body, preset, "chat", want_usage=want_usage)
    assert orjson.dumps(body) == sent  # copy-on-write: the parsed request stays as the client sent it
    body = plan.body
    wire = orjson.dumps(body)
    forwarded = orjson.loads(wire)  # valid RFC 8259 JSON, as the replica will parse it
    # messages and tools byte for byte, in the client's order (key order included).
    assert orjson.dumps(forwarded["messages"]) == orjson.dumps(original["messages"])
    if "tools" in original:
        assert orjson.dumps(forwarded["tools"]) == orjson.dumps(original["tools"])
    for key, value in original.items():
        if key not in OWNED:
            assert orjson.dumps(forwarded[key]) == orjson.dumps(value), key
    assert forwarded.get("stream") == original.get("stream")
    assert "task" not in forwarded and forwarded["model"] == preset.served_model
    kwargs = original.get("chat_template_kwargs", {})
    for key, value in kwargs.items():
        assert forwarded["chat_template_kwargs"][key] == value  # merged, never clobbered
    assert plan.stream == (original.get("stream") is True)
    # Idempotent: a second pass changes nothing.
    again = orjson.loads(wire)
    again = rewrite(again, preset, "chat", want_usage=want_usage).body
    assert orjson.dumps(again) == wire


def test_stream_options_without_a_stream_are_dropped_and_said_so() -> None:
    """vLLM answers 400 to stream_options on a non-streaming request; OpenAI ignores them."""
    body = chat(stream_options={"include_usage": True})
    plan = rewrite(body, PLAIN, "chat", want_usage=True)
    body = plan.body
    assert "stream_options" not in body
    assert ("stream_options_dropped", "stream_options=dropped") in plan.notes
