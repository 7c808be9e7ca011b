"""Whether a tool call's arguments fit the tool's declared JSON Schema: a small, bounded check.

Used to tell a call a model wrote as text from prose that merely looks like one (leaked.py): the
answer is repaired only when the arguments satisfy the declared schema. It runs on the relay's path,
event by event, so it must be cheap and finite whatever a client declares: the keywords that decide
the shape of an argument object (`type`, `enum`, `const`, `properties`, `required`,
`additionalProperties`, `items`, `prefixItems`, `anyOf`/`oneOf`/`allOf`, local `$ref`s) are
checked; the others (`pattern`, `format`, bounds) are left to the engine's own decoding and never
run a regular expression here. Every keyword evaluation is counted against a step budget; a schema
that uses it up, or a reference outside the schema, counts as "does not fit", so the text stays text.
"""

from __future__ import annotations

from typing import Any

MAX_STEPS = 20_000  # keyword evaluations per check: real tool schemas need tens to hundreds
MAX_DEPTH = 64  # nesting of the arguments checked

_NUMBER = (int, float)  # a tuple: `int | float` would be made again on every value checked
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
}


class _Exhausted(Exception):
    """The check used up its step budget or its depth."""


def conforms(value: Any, schema: Any, steps: int = MAX_STEPS) -> bool:
    """Whether `value` satisfies `schema` (a missing or non-object schema accepts anything)."""
    if not isinstance(schema, dict):
        return True
    try:
        return _Check(schema, steps).fits(value, schema, 0)
    except _Exhausted:
        return False


def is_type(value: Any, kind: Any) -> bool:
    """JSON Schema's `type` test for one type name (unknown names accept nothing)."""
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if kind == "number":
        return isinstance(value, _NUMBER) and not isinstance(value, bool)
    kinds = _TYPES.get(kind) if isinstance(kind, str) else None
    if kinds is None:
        return False
    if kind != "boolean" and isinstance(value, bool):
        return False
    return isinstance(value, kinds)


class _Check:
    def __init__(self, root: dict[str, Any], steps: int) -> None:
        self.root = root
        self.steps = steps

    def _step(self, depth: int) -> None:
        self.steps -= 1
        if self.steps < 0 or depth > MAX_DEPTH:
            raise _Exhausted

    def fits(self, value: Any, schema: Any, depth: int) -> bool:
        """Whether `value` satisfies `schema` (a boolean, None or a non-object schema as JSON Schema
        reads it), checking `$ref`, type, const, enum and the combinators here and objects and
        arrays below; each call spends a step and raises `_Exhausted` past the budget or
        `MAX_DEPTH`."""
        self._step(depth)
        if schema is True or schema is None:
            return True
        if schema is False:
            return False
        if not isinstance(schema, dict):
            return True
        ref = schema.get("$ref")
        if ref is not None and not self.fits(value, self._resolve(ref), depth + 1):
            return False
        kind = schema.get("type")
        if kind is not None:
            kinds = kind if isinstance(kind, list) else [kind]
            if not any(is_type(value, k) for k in kinds):
                return False
        if "const" in schema and not _same(value, schema["const"]):
            return False
        enum = schema.get("enum")
        if isinstance(enum, list) and not any(_same(value, option) for option in enum):
            return False
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            # oneOf is read as anyOf: telling a call from prose needs no exclusivity proof.
            if (
                isinstance(options, list)
                and options
                and not any(self.fits(value, o, depth + 1) for o in options)
            ):
                return False
        every = schema.get("allOf")
        if isinstance(every, list) and not all(self.fits(value, s, depth + 1) for s in every):
            return False
        if isinstance(value, dict):
            return self._object(value, schema, depth)
        if isinstance(value, list):
            return self._array(value, schema, depth)
        return True

    def _object(self, value: dict[str, Any], schema: dict[str, Any], depth: int) -> bool:
        required = schema.get("required")
        if isinstance(required, list) and any(isinstance(k, str) and k not in value for k in required):
            return False
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        additional = schema.get("additionalProperties", True)
        patterned = isinstance(schema.get("patternProperties"), dict)
        for key, item in value.items():
            self._step(depth)
            if key in properties:
                if not self.fits(item, properties[key], depth + 1):
                    return False
            elif patterned:
                continue  # matched by a pattern or not: patterns are the engine's to check
            elif additional is False or (
                isinstance(additional, dict) and not self.fits(item, additional, depth + 1)
            ):
                return False
        return True

    def _array(self, value: list[Any], schema: dict[str, Any], depth: int) -> bool:
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        if isinstance(items, list):  # draft 4-7 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        for index, item in enumerate(value):
            sub = prefix[index] if index < len(prefix) else items
            if sub is not None and not self.fits(item, sub, depth + 1):
                return False
        return True

    def _resolve(self, ref: Any) -> Any:
        """A reference inside the schema (`#`, `#/$defs/x`); anything else fits nothing."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return False
        node: Any = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return False
        return node


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 and 1.0 are equal, true and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def property_types(schema: Any, name: str) -> tuple[str, ...]:
    """The JSON types a property of an object schema may take (its `type`, or its `anyOf`/`oneOf`
    members' types), in declared order; empty when the schema does not say."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    sub = properties.get(name) if isinstance(properties, dict) else None
    if not isinstance(sub, dict):
        return ()
    found: list[str] = []
    for node in (sub, *(o for k in ("anyOf", "oneOf") for o in _list(sub.get(k)))):
        kind = node.get("type") if isinstance(node, dict) else None
        for k in kind if isinstance(kind, list) else [kind]:
            if isinstance(k, str) and k not in found:
                found.append(k)
        if isinstance(node, dict) and isinstance(node.get("enum"), list) and not kind:
            found += [t for t in _enum_types(node["enum"]) if t not in found]
    return tuple(found)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _enum_types(options: list[Any]) -> list[str]:
    kinds = []
    for option in options:
        kind = "string" if isinstance(option, str) else "boolean" if isinstance(option, bool) else None
        if kind is None and isinstance(option, _NUMBER):
            kind = "number"
        if kind is not None and kind not in kinds:
            kinds.append(kind)
    return kinds
