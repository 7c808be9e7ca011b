"""The JSON Schema a client gives `extract`: checked before it is sent, and used to check the answer,
without ever reading a file or a URL, and in bounded time.

A schema is the client's data. The JSON Schema libraries' defaults treat it as a program: a `$ref`
to `file:///...` or `http://...` is fetched (its content then shows in the error message, and a
listener that holds the socket freezes whatever waits on it), and `pattern` runs in Python's
backtracking regex engine, where `^(a+)+$` takes exponential time in the answer's length. Here:

- only references inside the schema itself (`#...`) are allowed; anything else is refused before
  the request is sent, and the validator's registry retrieves nothing should one slip through;
- `pattern` and `patternProperties` run in RE2 (linear time); a pattern RE2 cannot compile
  (backreferences, lookaround) is left to the engine's own constrained decoding and not re-checked;
- the schema's size and depth are bounded, every keyword evaluation is counted against a budget,
  and the check runs on a worker thread, so nothing a schema or an answer holds can stall the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # a dependency of the mcp SDK
import orjson
import re2  # type: ignore[import-untyped]
from referencing import Registry
from referencing.exceptions import Unresolvable

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
# An answer is checked up to this size and depth: each error message quotes the part of the answer
# it is about, so a huge or deeply nested answer costs its size again at every level.
MAX_ANSWER_BYTES = 1024 * 1024
MAX_ANSWER_DEPTH = 64
# Keyword evaluations per check: a real extraction schema over a real answer needs hundreds to a
# few thousand; nested `oneOf`s that refer back to the root multiply without end.
MAX_STEPS = 200_000
CHECK_TIMEOUT = 5.0  # seconds; the step budget ends a check long before this
REFERENCE_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # an unsupported pattern is expected input, not a log line


class SchemaRefused(ValueError):
    """The client's schema cannot be used; the message says why, in the client's terms."""


class TooComplex(Exception):
    """The check used up its step budget."""


def vet(schema: Any) -> None:
    """Refuse, before any GPU time, a schema that is too large, too deep, refers outside itself or
    is not a JSON Schema."""
    if not isinstance(schema, dict):
        raise SchemaRefused("json_schema must be an object")
    if len(orjson.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise SchemaRefused(f"json_schema is larger than {MAX_SCHEMA_BYTES // 1024} KiB")
    for where, value in _walk(schema):
        if where in REFERENCE_KEYS and not (isinstance(value, str) and value.startswith("#")):
            raise SchemaRefused(
                f"json_schema's {where} must point inside the schema ('#/...'): the gateway fetches "
                "no file or URL"
            )
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        # No format checker: the metaschema's `format: regex` would compile every pattern in
        # Python's engine, which is not the one that checks them.
        cls.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as exc:
        raise SchemaRefused(f"json_schema is not a valid JSON Schema: {exc.message}") from None


def _walk(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every (key, value) of the schema's objects, depth-first; past the depth bound, a refusal."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaRefused(f"json_schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            for key, value in node.items():
                yield key, value
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)


def _search(pattern: str, text: str) -> bool | None:
    """Whether RE2 finds `pattern` in `text`; None when RE2 cannot compile the pattern."""
    try:
        compiled = re2.compile(pattern, _RE2_OPTIONS)
    except re2.error:
        return None
    return compiled.search(text) is not None


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
    if validator.is_type(instance, "string") and _search(pattern, instance) is False:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: dict[str, Any]
) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(
    validator: Any, additional: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = schema.get("patternProperties", {})
    extras = [key for key in instance if key not in properties and not any(_search(p, key) for p in patterns)]
    if validator.is_type(additional, "object"):
        for key in extras:
            yield from validator.descend(instance[key], additional, path=key)
    elif not additional and extras:
        listed = ", ".join(repr(key) for key in sorted(extras)[:8])
        yield jsonschema.ValidationError(f"Additional properties are not allowed ({listed} unexpected)")


# Keywords whose stock implementation calls Python's `re`; `unevaluatedProperties` does too when
# patternProperties are in play, so that pairing is left to the engine (see `_without`).
_SAFE_KEYWORDS: dict[str, Callable[..., Iterator[Any]]] = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
}


def _counted(keyword: Callable[..., Any], budget: list[int]) -> Callable[..., Any]:
    def run(validator: Any, value: Any, instance: Any, schema: dict[str, Any]) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise TooComplex
        return keyword(validator, value, instance, schema)

    return run


def _without(schema: Any, key: str) -> Any:
    if isinstance(schema, dict):
        return {k: _without(v, key) for k, v in schema.items() if k != key}
    if isinstance(schema, list):
        return [_without(v, key) for v in schema]
    return schema


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_ANSWER_DEPTH:
            break
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _check(value: Any, schema: dict[str, Any], steps: int) -> str | None:
    if len(orjson.dumps(value)) > MAX_ANSWER_BYTES:
        return f"the answer is larger than {MAX_ANSWER_BYTES // 1024} KiB, too large to check"
    if _depth(value) > MAX_ANSWER_DEPTH:
        return f"the answer is nested deeper than {MAX_ANSWER_DEPTH} levels, too deep to check"
    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    budget = [steps]
    functions = {**base.VALIDATORS, **_SAFE_KEYWORDS}
    if "unevaluatedProperties" in functions and any(k == "patternProperties" for k, _ in _walk(schema)):
        schema = _without(schema, "unevaluatedProperties")
    validators = {name: _counted(fn, budget) for name, fn in functions.items()}
    cls = jsonschema.validators.extend(base, validators)
    # An empty registry: a reference that is not inside the schema is unresolvable, never fetched.
    validator = cls(schema, registry=Registry())
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except TooComplex:
        return "the schema is too complex to check this answer against (step limit)"
    except RecursionError:
        return "the schema refers to itself without end"
    except Unresolvable:  # jsonschema raises it wrapped, as a subclass
        return "the schema has a reference that does not resolve inside it"
    return None if error is None else str(error.message)[:500]


async def check(value: Any, schema: dict[str, Any], steps: int = MAX_STEPS) -> str | None:
    """Why `value` does not satisfy `schema` (already vetted), or None when it does."""
    try:
        async with asyncio.timeout(CHECK_TIMEOUT):
            return await asyncio.to_thread(_check, value, schema, steps)
    except TimeoutError:
        return "the schema check took too long"
