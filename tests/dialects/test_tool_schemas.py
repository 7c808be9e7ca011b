"""The `tool_schemas` fix and its one retry: what each engine cannot compile is removed, what it
accepts keeps its bytes, and a refused request is sent again without constraints on the tool the
engine's message points at (or, when it names none, on the tools that hold constraints)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.dialects import tool_schemas
from gateway.dialects.tool_schemas import fix, loosen, read_pattern, refused

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
LLAMA_GRAMMAR = "Failed to initialize samplers: failed to parse grammar"
LLAMA_PARSER = (
    "Unable to generate parser for this template. Automatic parser generation failed: JSON schema error at "
    "#/properties/zz: cannot resolve $ref #/$defs/nope, $defs not found"
)
LLAMA_PATTERN = (
    "Unable to generate parser for this template. Automatic parser generation failed: JSON schema "
    "conversion failed:\nInvalid pattern ^(x$: unbalanced parentheses"
)
VLLM_GRAMMAR = "Invalid grammar specification: 'triggers'"


def captured(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())["body"]  # type: ignore[no-any-return]


def chat_tool(name: str, schema: dict[str, Any], strict: bool | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": "d", "parameters": schema}
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def prop(**schema: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": schema}}


@pytest.mark.parametrize(
    "name", ["claude-code-messages.json", "codex-responses.json", "codex-responses-tool-output.json"]
)
def test_the_agents_captured_tool_lists_keep_their_bytes_on_both_engines(name: str) -> None:
    body = captured(name)
    before = orjson.dumps(body)
    sent = dict(body)
    assert fix(sent, ["llamacpp", "vllm"]) == []
    assert sent["tools"] is body["tools"] and orjson.dumps(sent) == before


def test_llama_server_loses_only_the_repetitions_it_cannot_build() -> None:
    schema = {
        "type": "object",
        "properties": {
            "script": {"type": "string", "maxLength": 524288, "minLength": 5000},
            "ids": {"type": "array", "minItems": 2001, "items": {"type": "string", "pattern": "^a{3000}$"}},
            "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$", "minLength": 2000},
            "n": {"type": "integer", "minimum": -9007199254740991, "maximum": 9007199254740991},
        },
    }
    body = {"tools": [chat_tool("t", schema)]}
    notes = fix(body, ["llamacpp"])
    sent = body["tools"][0]["function"]["parameters"]["properties"]
    assert notes == [("tool_schemas", "keywords_removed=3")]
    assert sent["script"] == {"type": "string", "maxLength": 524288}
    assert sent["ids"] == {"type": "array", "items": {"type": "string"}}
    assert sent["date"] == schema["properties"]["date"] and sent["n"] == schema["properties"]["n"]


def test_a_property_named_like_a_keyword_is_not_a_keyword() -> None:
    # Claude Code's Grep tool has a property called `pattern`; Workflow one called `args`.
    schema = {
        "type": "object",
        "properties": {"pattern": {"type": "string"}, "minLength": {"type": "integer"}},
    }
    body = {"tools": [chat_tool("Grep", schema)]}
    assert fix(body, ["llamacpp", "vllm"]) == []


def test_refs_llama_server_cannot_resolve_are_removed_and_local_ones_kept() -> None:
    schema = {
        "type": "object",
        "$defs": {"s": {"type": "string"}},
        "properties": {
            "ok": {"$ref": "#/$defs/s"},
            "missing": {"$ref": "#/$defs/nope"},
            "remote": {"$ref": "https://example.com/x.json"},
        },
    }
    body = {"tools": [{"name": "m", "input_schema": schema}]}  # the Messages form
    fix(body, ["llamacpp"])
    properties = body["tools"][0]["input_schema"]["properties"]
    assert properties == {"ok": {"$ref": "#/$defs/s"}, "missing": {}, "remote": {}}


def test_vllm_changes_strict_tools_only() -> None:
    unicode = prop(type="string", pattern=r"^\p{L}+$")
    body = {
        "tools": [
            {"type": "function", "name": "loose", "parameters": unicode},  # the Responses form
            {"type": "function", "name": "strict", "parameters": unicode, "strict": True},
        ]
    }
    fix(body, ["vllm"])
    assert body["tools"][0]["parameters"] is unicode
    assert body["tools"][1]["parameters"] == {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.mark.parametrize(
    ("schema", "removed"),
    [
        (prop(type="string", pattern="^a{128}$"), False),
        (prop(type="string", pattern="^a{129}$"), True),
        (prop(type="string", pattern="^a{0,150}$"), True),
        (prop(type="string", pattern=r"^(a)\1$"), True),
        (prop(type="string", pattern="(?<x>a)\\k<x>"), True),
        (prop(type="string", pattern="^(abc$"), True),
        (prop(type="string", pattern=r"^[\w.-]+$"), False),
        (prop(type="object", minProperties=1), True),
        (prop(type="object", maxProperties=2), False),
        (prop(type="array", items={"type": "string"}, uniqueItems=True), False),
    ],
)
def test_what_vllm_cannot_compile_in_a_strict_tool(schema: dict[str, Any], removed: bool) -> None:
    body = {"tools": [chat_tool("t", schema, strict=True)]}
    assert bool(fix(body, ["vllm"])) is removed


def test_the_fix_is_copy_on_write() -> None:
    schema = prop(type="string", minLength=9000)
    tools = [chat_tool("t", schema), chat_tool("u", prop(type="string"))]
    client = {"tools": tools}
    snapshot = copy.deepcopy(client)
    body = dict(client)
    fix(body, ["llamacpp"])
    assert client == snapshot and body["tools"] is not tools
    assert body["tools"][1] is tools[1]  # an untouched tool is the client's own object


def test_a_schema_too_large_to_walk_is_left_as_it_came() -> None:
    deep: dict[str, Any] = {"type": "string", "minLength": 9000}
    for _ in range(50):
        deep = {"type": "object", "properties": {f"p{i}": deep for i in range(3)}}
    body = {"tools": [chat_tool("t", deep)]}
    fix(body, ["llamacpp"])  # bounded: returns, whatever it managed to clean
    assert isinstance(body["tools"], list)


@pytest.mark.pure
def test_a_tool_list_that_needed_nothing_is_not_walked_again() -> None:
    body = captured("claude-code-messages.json")
    known = tool_schemas.CleanLists()
    walks = 0
    clean = tool_schemas._clean

    def counted(*args: Any) -> Any:
        nonlocal walks
        walks += 1
        return clean(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tool_schemas, "_clean", counted)
        for _ in range(3):
            sent = dict(body)
            assert fix(sent, ["llamacpp"], known) == [] and sent["tools"] is body["tools"]
        first = walks
        # The same list sent again, as another request parses it: equal, not the same objects.
        assert fix(copy.deepcopy(body), ["llamacpp"], known) == []
    assert first > 0 and walks == first and len(known) == 1  # walked on the first request only


def test_a_tool_list_the_fix_changes_is_fixed_on_every_request() -> None:
    known = tool_schemas.CleanLists()
    for _ in range(2):
        body = {"tools": [chat_tool("t", prop(type="string", minLength=9000))]}
        assert fix(body, ["llamacpp"], known) == [("tool_schemas", "keywords_removed=1")]
        assert body["tools"][0]["function"]["parameters"] == prop(type="string")
    assert len(known) == 0


def test_a_list_known_clean_for_llama_server_alone_is_checked_again_with_vllm_beside_it() -> None:
    # vLLM compiles strict tools, so the same list may need its fix once vLLM is among the engines.
    known = tool_schemas.CleanLists()
    tools = [chat_tool("t", prop(type="object", minProperties=1), strict=True)]
    assert fix({"tools": tools}, ["llamacpp"], known) == []
    body = {"tools": tools}
    assert fix(body, ["llamacpp", "vllm"], known) == [("tool_schemas", "keywords_removed=1")]


def test_with_the_walks_json_a_list_is_remembered_for_vllm_too() -> None:
    body = captured("codex-responses.json")
    known = tool_schemas.CleanLists()
    data = orjson.dumps(body["tools"])
    for _ in range(2):
        assert fix(dict(body), ["vllm"], known, data) == []
    assert len(known) == 1
    assert fix(dict(body), ["llamacpp", "vllm"], known, data) == [] and len(known) == 2


@pytest.mark.parametrize(
    "name", ["claude-code-messages.json", "codex-responses.json", "codex-responses-tool-output.json"]
)
def test_with_known_lists_every_fix_is_the_fix_without(name: str) -> None:
    lists = [
        captured(name)["tools"],
        [chat_tool("t", prop(type="string", minLength=9000)), chat_tool("u", prop(type="string"))],
        [chat_tool("t", prop(type="string", pattern=r"^\p{L}+$"), strict=True)],
    ]
    known = tool_schemas.CleanLists(size=2)  # small: lists leave it and come back
    for _ in range(3):
        for tools in lists:
            for engines in (["llamacpp"], ["vllm"], ["llamacpp", "vllm"]):
                plain, remembered = {"tools": copy.deepcopy(tools)}, {"tools": copy.deepcopy(tools)}
                assert fix(plain, engines) == fix(remembered, engines, known)
                assert orjson.dumps(plain) == orjson.dumps(remembered)
    assert len(known) <= 2


def test_reading_patterns() -> None:
    assert read_pattern(r"^\d{4}-\d{2}$").valid
    assert read_pattern(r"^[^\]]+$").valid
    assert not read_pattern("^(abc$").valid and not read_pattern("abc)").valid
    assert not read_pattern("[abc").valid and not read_pattern("abc\\").valid
    facts = read_pattern("^a{3,2001}b{12}$")
    assert (facts.min_repeat, facts.max_bound) == (12, 2001)
    assert read_pattern(r"\p{Lu}").unicode_class and read_pattern(r"(a)\1").backreference
    assert read_pattern("a{x}").valid  # a brace that is no quantifier is a literal


def test_the_engines_refusals_are_recognised_and_other_errors_are_not() -> None:
    for message in (LLAMA_GRAMMAR, LLAMA_PARSER, LLAMA_PATTERN, VLLM_GRAMMAR):
        assert refused(message)
    assert not refused("request (29055 tokens) exceeds the available context size (8192 tokens)")
    assert not refused("tiny is not a multimodal model")


def two_tools(second: dict[str, Any]) -> dict[str, Any]:
    return {"tools": [chat_tool("first", prop(type="string", maxLength=10)), chat_tool("second", second)]}


def test_the_retry_unconstrains_the_tool_a_ref_in_the_message_points_at() -> None:
    body = two_tools({"type": "object", "properties": {"zz": {"$ref": "#/$defs/nope"}}})
    found = loosen(body, "llamacpp", LLAMA_PARSER)
    assert found is not None
    sent, note = found
    assert note == ("tool_schemas", "unconstrained_retry=1")
    assert sent["tools"][0] is body["tools"][0]
    second = sent["tools"][1]["function"]
    assert second["parameters"] == {"type": "object", "properties": {"zz": {}}}
    assert '"$ref":"#/$defs/nope"' in second["description"]  # the schema, as text for the model


def test_the_retry_finds_the_pattern_llama_server_names() -> None:
    body = two_tools({"type": "object", "properties": {"zz": {"type": "string", "pattern": "^(x$"}}})
    found = loosen(body, "llamacpp", LLAMA_PATTERN)
    assert found is not None and found[0]["tools"][0] is body["tools"][0]


def test_without_a_hint_the_retry_unconstrains_every_tool_with_constraints() -> None:
    body = {
        "tools": [
            chat_tool("plain", {"type": "object", "properties": {"a": {"type": "string"}}}),
            chat_tool("bounded", prop(type="string", minLength=3)),
        ]
    }
    found = loosen(body, "llamacpp", LLAMA_GRAMMAR)
    assert found is not None
    sent = found[0]["tools"]
    assert sent[0] is body["tools"][0] and sent[1]["function"]["parameters"]["properties"] == {
        "a": {"type": "string"}
    }


def test_the_retry_on_vllm_sends_strict_tools_as_not_strict_with_their_schema() -> None:
    schema = prop(type="string", pattern="^x$")
    body = {"tools": [chat_tool("loose", schema), chat_tool("strict", schema, strict=True)]}
    found = loosen(body, "vllm", VLLM_GRAMMAR)
    assert found is not None
    strict = found[0]["tools"][1]["function"]
    assert strict["strict"] is False and strict["parameters"] is schema
    assert found[0]["tools"][0] is body["tools"][0]


def test_no_retry_for_other_errors_or_without_tools() -> None:
    body = two_tools(prop(type="string", minLength=3))
    assert loosen(body, "llamacpp", "tiny is not a multimodal model") is None
    assert loosen({"messages": []}, "llamacpp", LLAMA_GRAMMAR) is None
    # vLLM compiles strict tools only: with none, no tool can be the cause.
    assert loosen(body, "vllm", VLLM_GRAMMAR) is None


def test_the_retry_keeps_the_argument_names_types_and_required() -> None:
    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "pattern": "^/", "description": "Where"},
            "n": {"minimum": 1},
            "odd": {"type": "nonsense"},
        },
        "required": ["path"],
    }
    tool = tool_schemas.unconstrained(
        {"name": "Read", "description": "Reads", "input_schema": schema}, "llamacpp"
    )
    assert tool["input_schema"] == {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "Where"}, "n": {}, "odd": {}},
        "required": ["path"],
    }
    assert tool["description"].startswith("Reads\n\nIts arguments follow this JSON Schema")


def test_the_engines_message_is_read_from_each_envelope() -> None:
    llama = orjson.dumps({"error": {"code": 400, "message": LLAMA_PARSER, "type": "invalid_request_error"}})
    anthropic = orjson.dumps({"type": "error", "error": {"type": "BadRequestError", "message": VLLM_GRAMMAR}})
    assert tool_schemas.message_of(llama) == LLAMA_PARSER
    assert tool_schemas.message_of(anthropic) == VLLM_GRAMMAR
    assert tool_schemas.message_of(b"not json") == "" and tool_schemas.message_of(b"[1]") == ""
