"""The MCP tools' pure parts: descriptions from the table, the requests they become, the
simulator's answer to a JSON-schema response format."""

from __future__ import annotations

import jsonschema  # type: ignore[import-untyped]
import pytest

from gateway.mcp import tools
from gateway.routing.table import TableError, parse_table
from gateway.simulator.script import schema_instance, structured

TABLE = """
presets:
  dense: {served_model: d, description: "Hard code.", replicas: [{name: a, url: "http://127.0.0.1:1", engine: vllm}]}
  eyes: {served_model: v, vision: true, replicas: [{name: b, url: "http://127.0.0.1:2", engine: vllm}]}
tasks: {code: dense, extract: dense}
routing: {default: dense, images: eyes}
"""


def test_descriptions_quote_the_presets_their_tasks_and_measured_speed() -> None:
    table = parse_table(TABLE, "t.yaml")
    described = tools.descriptions(table, {"dense": 41.6, "eyes": None})
    assert (
        "- dense (d): Hard code. Tasks: code, extract; decodes ~42 tokens/s lately" in described["delegate"]
    )
    assert "- eyes (v): Tasks: none; reads images" in described["delegate"]
    assert "'dense' preset" in described["extract"] and "'eyes' preset" in described["look"]


def test_a_description_is_one_sentence_not_an_essay() -> None:
    with pytest.raises(TableError, match="description"):
        parse_table(TABLE.replace('"Hard code."', "x" * 301), "t.yaml")


def test_delegate_puts_system_then_context_then_prompt() -> None:
    body = tools.delegate_body(
        {"task": "code", "prompt": "P", "context": "C", "system": "S", "max_tokens": 9}
    )
    assert body == {
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "C\n\nP"}],
        "model": "auto",
        "task": "code",
        "max_tokens": 9,
    }
    assert tools.delegate_body({"task": "code", "prompt": "P", "preset": "eyes"})["model"] == "eyes"
    assert "task" not in tools.delegate_body({"task": "code", "prompt": "P", "preset": "eyes"})


def test_extract_uses_the_extract_task_and_a_strict_schema() -> None:
    table = parse_table(TABLE, "t.yaml")
    body = tools.extract_body({"prompt": "P", "json_schema": {"type": "object"}}, table)
    assert body["task"] == "extract"
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize(
    ("image", "url"),
    [
        ("data:image/webp;base64,AAAA", "data:image/webp;base64,AAAA"),
        ("iVBORw0KGgo", "data:image/png;base64,iVBORw0KGgo"),
        ("/9j/4AAQ", "data:image/jpeg;base64,/9j/4AAQ"),
    ],
)
def test_images_become_data_urls(image: str, url: str) -> None:
    assert tools.image_url(image) == url


@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
            "required": ["a"],
        },
        {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2},
        {"type": "object", "properties": {"n": {"type": ["null", "number"], "minimum": 3}}},
        {"anyOf": [{"type": "boolean"}, {"type": "string"}]},
        {"type": "object", "properties": {"k": {"const": 7}, "s": {"type": "string", "minLength": 9}}},
    ],
)
def test_the_simulator_answers_a_value_that_satisfies_the_schema(schema: dict[str, object]) -> None:
    jsonschema.validate(schema_instance(schema), schema)
    plan = structured({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    assert plan is not None and plan.echo is not None and " " not in plan.echo


def test_no_schema_no_plan() -> None:
    assert structured({"response_format": {"type": "json_object"}}) is None
    assert structured({}) is None
