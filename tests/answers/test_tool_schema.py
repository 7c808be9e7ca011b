"""The bounded check that tells a leaked call's arguments from prose: the keywords that decide an
argument object's shape, and a finite answer whatever a client declares."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.answers.tool_schema import conforms, property_types

READ = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "file_path": {"type": "string"},
        "offset": {"type": "integer"},
        "mode": {"enum": ["text", "bytes"]},
        "lines": {"type": "array", "items": {"type": "integer"}},
        "owner": {"$ref": "#/$defs/owner"},
    },
    "required": ["file_path"],
    "additionalProperties": False,
    "$defs": {"owner": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
}


@pytest.mark.parametrize(
    "value",
    [
        {"file_path": "a"},
        {"file_path": "a", "offset": 3, "mode": "bytes", "lines": [1, 2]},
        {"file_path": "a", "offset": 3.0},
        {"file_path": "a", "owner": {"name": "x"}},
    ],
)
def test_arguments_that_fit_the_schema_conform(value: dict[str, Any]) -> None:
    assert conforms(value, READ)


@pytest.mark.parametrize(
    "value",
    [
        {},  # required missing
        {"file_path": 1},
        {"file_path": "a", "offset": True},  # a boolean is no integer
        {"file_path": "a", "offset": 1.5},
        {"file_path": "a", "mode": "words"},
        {"file_path": "a", "lines": ["1"]},
        {"file_path": "a", "owner": {}},
        {"file_path": "a", "other": 1},  # additionalProperties: false
    ],
)
def test_arguments_that_do_not_fit_do_not_conform(value: dict[str, Any]) -> None:
    assert not conforms(value, READ)


def test_any_of_one_of_and_all_of_are_read() -> None:
    either = {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    assert conforms(1, either) and conforms("a", either) and not conforms([], either)
    assert conforms(1, {"oneOf": [{"type": "integer"}, {"type": "number"}]})  # read as anyOf
    assert not conforms(1, {"allOf": [{"type": "integer"}, {"type": "string"}]})


def test_a_reference_outside_the_schema_fits_nothing() -> None:
    assert not conforms({"a": 1}, {"$ref": "https://example.invalid/schema.json"})
    assert not conforms({"a": 1}, {"$ref": "#/$defs/missing"})


def test_a_schema_that_refers_to_itself_without_end_is_refused_in_bounded_steps() -> None:
    endless = {"$ref": "#"}
    assert not conforms({"a": 1}, endless)
    wide = {"type": "object", "properties": {f"p{i}": {"anyOf": [{"$ref": "#"}] * 5} for i in range(50)}}
    value: Any = {}
    for _ in range(40):
        value = {f"p{i}": value for i in range(3)}
    assert conforms(value, wide, steps=100) is False


def test_no_schema_accepts_any_arguments() -> None:
    assert conforms({"x": 1}, None) and conforms({"x": 1}, {})


def test_a_propertys_types_come_from_its_type_or_its_members() -> None:
    schema = {
        "properties": {
            "a": {"type": ["integer", "null"]},
            "b": {"anyOf": [{"type": "boolean"}, {"type": "string"}]},
            "c": {"enum": ["x", 1]},
        }
    }
    assert property_types(schema, "a") == ("integer", "null")
    assert property_types(schema, "b") == ("boolean", "string")
    assert property_types(schema, "c") == ("string", "number")
    assert property_types(schema, "missing") == ()
