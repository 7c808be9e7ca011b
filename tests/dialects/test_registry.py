import pytest

from gateway.dialects.anthropic import ANTHROPIC
from gateway.dialects.openai import OPENAI
from gateway.dialects.registry import BY_NAME, ENDPOINTS, dialect_for, for_path
from gateway.dialects.responses import RESPONSES
from gateway.errors import BadRequest
from gateway.pipeline.rewrite import cap_to_context, check_request, rewrite
from gateway.routing.table import parse_table

TABLE = parse_table(
    """
defaults: {max_tokens: 8192, min_max_tokens: 1024}
presets:
  plain:
    served_model: served-plain
    aliases: ["claude-*opus*", "gpt-*"]
    replicas: [{name: a, url: "http://127.0.0.1:1", engine: vllm}]
  small:
    served_model: served-small
    aliases: ["claude-*haiku*", "claude-*"]
    replicas: [{name: b, url: "http://127.0.0.1:2", engine: llamacpp}]
routing: {default: plain}
"""
)
PLAIN = TABLE.presets["plain"]


def test_every_path_names_one_endpoint() -> None:
    paths = [path for e in ENDPOINTS for path in (e.path, *e.aliases)]
    assert len(paths) == len(set(paths))
    for endpoint in ENDPOINTS:
        assert for_path(endpoint.path) is endpoint
        assert endpoint.upstream, endpoint.name


@pytest.mark.parametrize(
    ("path", "dialect"),
    [
        ("/v1/messages", ANTHROPIC),
        ("/v1/messages/count_tokens", ANTHROPIC),
        ("/v1/responses", RESPONSES),
        ("/v1/responses/resp_1", RESPONSES),
        ("/v1/chat/completions", OPENAI),
        ("/nope", OPENAI),
    ],
)
def test_errors_speak_the_dialect_of_the_path(path: str, dialect: object) -> None:
    assert dialect_for(path) is dialect


def test_infill_only_on_llamacpp() -> None:
    infill = BY_NAME["infill"]
    assert infill.serves("llamacpp") and not infill.serves("vllm")


@pytest.mark.parametrize(
    ("endpoint", "body", "key"),
    [
        ("chat", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ("messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ("responses", {"input": "x"}, "max_output_tokens"),
    ],
)
def test_the_budget_lands_in_each_dialects_own_key(endpoint: str, body: dict[str, object], key: str) -> None:
    plan = rewrite(body, PLAIN, endpoint, want_usage=True)
    body = plan.body
    assert body[key] == 8192
    assert ("max_tokens_set", f"{key}=8192") in plan.notes
    capped, note = cap_to_context(body, 1024, endpoint)
    assert capped[key] == 1024 and note == ("max_tokens_capped", f"{key}=8192->1024")


def test_claude_codes_64000_is_kept_then_capped_per_replica() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 64000, "stream": True}
    plan = rewrite(body, PLAIN, "messages", want_usage=True)
    body = plan.body
    assert body["max_tokens"] == 64000 and not plan.usage_injected and "stream_options" not in body
    assert cap_to_context(body, 8192, "messages")[0]["max_tokens"] == 8192


def test_utility_endpoints_get_no_budget_or_thinking() -> None:
    body = {"model": "plain", "input": ["a", "b"]}
    plan = rewrite(body, PLAIN, "embeddings", want_usage=True)
    body = plan.body
    assert body == {"model": "served-plain", "input": ["a", "b"]} and plan.notes == []


@pytest.mark.parametrize(
    ("endpoint", "body"), [("embeddings", {}), ("responses", {"input": "x", "max_output_tokens": 0})]
)
def test_checks_per_endpoint(endpoint: str, body: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        check_request(body, endpoint)


@pytest.mark.parametrize(
    ("model", "preset", "reason"),
    [
        ("claude-opus-4-8", "plain", "pattern"),
        ("claude-opus-4-8[1m]", "plain", "pattern"),
        ("claude-haiku-4-5-20251001", "small", "pattern"),
        ("claude-sonnet-4-6", "small", "pattern"),
        ("GPT-5.1-codex", "plain", "pattern"),
        ("openai/plain", "plain", "model"),
        ("anthropic/claude-opus-4-8", "plain", "pattern"),
        ("small", "small", "model"),
    ],
)
def test_agent_model_names(model: str, preset: str, reason: str) -> None:
    route = TABLE.resolve(model, None, False)
    assert (route.preset.name, route.reason) == (preset, reason)


def test_pattern_overlaps_are_reported() -> None:
    assert TABLE.pattern_overlaps() == []  # opus first, then haiku, then the catch-all: no shadow
    table = parse_table(
        """
presets:
  a: {served_model: a, aliases: ["claude-*"], replicas: [{name: x, url: "http://127.0.0.1:1", engine: vllm}]}
  b: {served_model: b, aliases: ["claude-*haiku*"], replicas: [{name: y, url: "http://127.0.0.1:2", engine: vllm}]}
routing: {default: a}
"""
    )
    assert table.pattern_overlaps() == ["'claude-*haiku*' (b) is shadowed by 'claude-*' (a)"]
    assert table.resolve("claude-haiku-4", None, False).preset.name == "a"


@pytest.mark.parametrize("endpoint", ["chat", "messages"])
def test_a_part_type_that_is_no_string_is_named_by_its_place(endpoint: str) -> None:
    text = {"type": "text", "text": "same"}
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "user", "content": [dict(text), dict(text), {"type": ["image"]}, {"type": ["image"]}]},
        ],
    }
    with pytest.raises(BadRequest) as raised:
        check_request(body, endpoint)
    assert raised.value.param == "messages[1].content[2].type"
