"""The extract tool's schema check: no file or URL is ever read, regexes run in linear time, and
the work a schema can cause is bounded."""

from __future__ import annotations

import socket
import threading
from typing import Any

import orjson
import pytest

from gateway.mcp.schema import SchemaRefused, check, vet

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.mark.anyio
async def test_an_answer_that_satisfies_the_schema_passes_and_one_that_does_not_is_named() -> None:
    assert await check({"name": "Ann", "age": 7}, PERSON) is None
    problem = await check({"name": "Ann"}, PERSON)
    assert problem is not None and "'age' is a required property" in problem


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [{"$ref": "file:///etc/passwd"}]},
        {"type": "string", "not": {"$ref": "http://127.0.0.1:9/x"}},
        {"$id": "file:///etc/", "allOf": [{"$ref": "passwd"}]},
        {"$dynamicRef": "https://example.com/s"},
        {"properties": {"a": {"$ref": 7}}},
    ],
)
def test_a_reference_outside_the_schema_is_refused_before_sending(schema: dict[str, Any]) -> None:
    with pytest.raises(SchemaRefused, match="must point inside the schema"):
        vet(schema)


def test_local_references_are_allowed_and_resolved() -> None:
    schema = {"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}}
    vet(schema)


@pytest.mark.anyio
async def test_local_references_are_checked() -> None:
    schema = {"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}}
    assert await check([1, 2], schema) is None
    assert await check([1, "x"], schema) is not None


class _Listener:
    """A socket that counts the connections it is offered and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.accepted = 0
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/x"

    def _run(self) -> None:
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.mark.anyio
async def test_an_unvetted_remote_reference_is_unresolvable_not_fetched(tmp_path: Any) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"const": "TOP-SECRET-VALUE"}')
    listener = _Listener()
    try:
        for ref in (secret.as_uri(), listener.url):
            problem = await check("x", {"allOf": [{"$ref": ref}]})
            assert problem is not None and "does not resolve" in problem
            assert "TOP-SECRET" not in problem
    finally:
        listener.close()
    assert listener.accepted == 0


@pytest.mark.anyio
async def test_a_backtracking_pattern_is_checked_in_linear_time() -> None:
    # In Python's engine this pair takes on the order of 2**60 steps; RE2 answers at once.
    schema = {"type": "string", "pattern": "^(x+)+y$"}
    problem = await check("x" * 60, schema)
    assert problem is not None and "does not match" in problem
    assert await check("x" * 60 + "y", schema) is None


@pytest.mark.anyio
async def test_pattern_properties_and_additional_properties_use_the_same_engine() -> None:
    schema = {
        "type": "object",
        "patternProperties": {"^(a+)+$": {"type": "integer"}},
        "additionalProperties": False,
    }
    assert await check({"aaa": 1}, schema) is None
    assert await check({"aaa": "one"}, schema) == "'one' is not of type 'integer'"
    problem = await check({"a" * 40 + "b": 1}, schema)
    assert problem is not None and "Additional properties are not allowed" in problem


@pytest.mark.anyio
async def test_a_pattern_re2_cannot_compile_is_left_to_the_engine() -> None:
    # A backreference: the engine's constrained decoding enforced it, the gateway does not re-check.
    assert await check("ab", {"type": "string", "pattern": r"(a)\1"}) is None


@pytest.mark.anyio
async def test_a_schema_that_multiplies_work_ends_at_the_step_budget() -> None:
    nested = orjson.loads("[" * 12 + "0" + ",0]" * 12)
    schema = {"oneOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#"}}, {"$ref": "#"}]}
    problem = await check(nested, schema, steps=200)
    assert problem is not None and ("step limit" in problem or "without end" in problem)


@pytest.mark.anyio
async def test_an_answer_too_large_or_too_deep_is_not_checked() -> None:
    assert "too large" in (await check(["x" * 1024] * 1100, {"type": "array"}) or "")
    assert "too deep" in (await check(orjson.loads("[" * 80 + "]" * 80), {"type": "array"}) or "")


@pytest.mark.anyio
async def test_a_schema_that_refers_to_itself_without_end_is_an_answer_not_a_crash() -> None:
    problem = await check(1, {"allOf": [{"$ref": "#"}]})
    assert problem is not None


def test_a_schema_too_large_or_too_deep_is_refused() -> None:
    with pytest.raises(SchemaRefused, match="larger than"):
        vet({"enum": ["x" * 1000] * 100})
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(SchemaRefused, match="deeper than"):
        vet(deep)


def test_a_schema_that_is_not_json_schema_is_refused() -> None:
    with pytest.raises(SchemaRefused, match="not a valid JSON Schema"):
        vet({"type": 12})
