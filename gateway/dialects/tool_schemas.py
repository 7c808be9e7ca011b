"""Tool schemas every engine can compile: the `tool_schemas` fix and its one retry.

llama-server turns every tool's JSON Schema into a grammar on every request (tool_choice `auto`
included); vLLM compiles a tool's schema only when the tool says `strict: true`, and then on every
request too. A schema the engine cannot compile fails the whole request before a token is made, and
the agent sends the same tool list on every turn, so one bad tool ends the session on its first
request. Measured on the engines the tests install (llama-server b11434, vLLM 0.32.0 CPU; tool lists
of one tool, chat, Messages and Responses alike, docs/agents.md):

- llama-server: a repetition whose minimum is above 2000 (`minLength`, `minItems`, `a{2001}` in a
  `pattern`) is a 400 "Failed to initialize samplers: failed to parse grammar"; a `$ref` outside the
  document or one that resolves to nothing, and a malformed `pattern`, a 400 "Unable to generate
  parser for this template ... JSON schema error at #/properties/a: ..." (or "... Invalid pattern P:
  ..."). `format`, `propertyNames`, `patternProperties`, `\\d`, `\\p{L}`, look-arounds, a `maxLength` of
  524288 or 10^8 and integer bounds of 2^53 all compile.
- vLLM, strict tools: a `pattern` with `\\p{..}` classes, a back-reference or a malformed one, a
  `minProperties`, or a `$ref` that resolves to nothing is a 400 "Invalid grammar specification:
  'triggers'"; a counted repetition above 128 (`a{129}`, `a{0,150}`) a 500 after the engine core
  failed to compile it. Tools without `strict` are never compiled: every schema passes.

The fix removes exactly those keywords, and only for the engines of the preset: a tool list the
engines accept keeps its bytes (Claude Code's and Codex's captured lists are accepted as they come).
When an engine still refuses with a grammar error (another build, another rule), `loosen` picks the
failing tool (see there) and the request is sent once more without constraints on it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from gateway.dialects.base import Note
from gateway.lru import Lru
from gateway.types import ReadBytes

LLAMACPP = "llamacpp"
VLLM = "vllm"
# llama-server's grammar parser refuses a repetition whose minimum is above this ("number of
# repetitions exceeds sane defaults"); the maximum alone never failed.
LLAMA_MAX_MIN_REPEAT = 2000
# vLLM's xgrammar fails to compile a strict tool's pattern with a counted bound above this.
VLLM_MAX_REPEAT = 128
# Walking is bounded whatever a client sends: a schema with more nodes is left as it came.
MAX_NODES = 20_000

# The engines' words for a tool list they could not compile (the start of their 400 messages).
REFUSALS = (
    "failed to parse grammar",  # llama-server, the GBNF parser (names neither tool nor keyword)
    "unable to generate parser",  # llama-server, schema -> parser conversion
    "json schema conversion failed",
    "invalid grammar specification",  # vLLM, a strict tool's schema
    "grammar error:",  # vLLM, xgrammar or llguidance compile
)

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# What a grammar is built from: a tool whose schema holds none of these cannot be the one that failed.
CONSTRAINTS = frozenset(
    {
        "pattern",
        "format",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "patternProperties",
        "$ref",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "if",
        "not",
        "unevaluatedProperties",
        "unevaluatedItems",
        "prefixItems",
    }
)
JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_QUANTIFIER = re.compile(r"\{(\d{1,12})(,(\d{0,12}))?\}")
_HINT_PATTERN = re.compile(r"Invalid pattern (.+?): ", re.DOTALL)
_HINT_REF = re.compile(r"\$ref (\S+?)[,;]")
_HINT_POINTER = re.compile(r"JSON schema error at #(/\S*?):")


@dataclass(frozen=True)
class Pattern:
    """What matters to a grammar builder about one regex, read without compiling it."""

    valid: bool
    min_repeat: int  # the largest minimum of a counted repetition ({n}, {n,}, {n,m})
    max_bound: int  # the largest number in a counted repetition
    unicode_class: bool  # \p{..} or \P{..}
    backreference: bool  # \1 .. \9 or \k<name>


def read_pattern(pattern: str) -> Pattern:
    """A linear scan of an ECMA-style regex: brackets, groups, escapes and counted repetitions."""
    depth = min_repeat = max_bound = 0
    unicode_class = backreference = False
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":
            if i + 1 >= n:
                return Pattern(False, min_repeat, max_bound, unicode_class, backreference)
            escaped = pattern[i + 1]
            unicode_class |= escaped in "pP" and pattern.startswith("{", i + 2)
            backreference |= escaped in "123456789" or (escaped == "k" and pattern.startswith("<", i + 2))
            i += 2
            continue
        if char == "[":
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            if i >= n:
                return Pattern(False, min_repeat, max_bound, unicode_class, backreference)
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                return Pattern(False, min_repeat, max_bound, unicode_class, backreference)
        elif char == "{" and (found := _QUANTIFIER.match(pattern, i)) is not None:
            low = int(found.group(1))
            high = int(found.group(3)) if found.group(3) else low
            min_repeat, max_bound = max(min_repeat, low), max(max_bound, low, high)
            i = found.end()
            continue
        i += 1
    return Pattern(depth == 0, min_repeat, max_bound, unicode_class, backreference)


def _resolves(root: Any, ref: str) -> bool:
    """Whether a local `$ref` (`#` or `#/a/b`) names a value of the tool's own schema."""
    if ref == "#":
        return True
    if not ref.startswith("#/"):
        return False
    node = root
    for raw in ref[2:].split("/"):
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return False
    return True


Rule = Callable[[str, Any, Any], bool]  # (keyword, value, the tool's root schema) -> drop it


def _llama_rule(key: str, value: Any, root: Any) -> bool:
    if key in ("minLength", "minItems"):
        return isinstance(value, int) and value > LLAMA_MAX_MIN_REPEAT
    if key == "pattern" and isinstance(value, str):
        facts = read_pattern(value)
        return not facts.valid or facts.min_repeat > LLAMA_MAX_MIN_REPEAT
    if key == "$ref" and isinstance(value, str):
        return not _resolves(root, value)
    return False


def _vllm_rule(key: str, value: Any, root: Any) -> bool:
    if key == "minProperties":
        return True
    if key == "pattern" and isinstance(value, str):
        facts = read_pattern(value)
        return (
            not facts.valid or facts.unicode_class or facts.backreference or facts.max_bound > VLLM_MAX_REPEAT
        )
    if key == "$ref" and isinstance(value, str):
        return value.startswith("#") and not _resolves(root, value)
    return False


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_NODES

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _clean(node: Any, rule: Rule, root: Any, budget: _Budget, dropped: list[str]) -> Any:
    """The schema without the keywords `rule` drops; the same object where nothing changed."""
    if not isinstance(node, dict) or not budget.take():
        return node
    out: dict[str, Any] | None = None
    for key, value in node.items():
        new = value
        if rule(key, value, root):
            dropped.append(key)
            if out is None:
                out = dict(node)
            del out[key]
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            changed = {k: _clean(v, rule, root, budget, dropped) for k, v in value.items()}
            if any(changed[k] is not value[k] for k in value):
                new = changed
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            items = [_clean(v, rule, root, budget, dropped) for v in value]
            if any(a is not b for a, b in zip(items, value, strict=True)):
                new = items
        elif key in _SCHEMA_ONE:
            new = _clean(value, rule, root, budget, dropped)
        if new is not value:
            if out is None:
                out = dict(node)
            out[key] = new
    return node if out is None else out


def subschemas(node: Any, budget: _Budget | None = None) -> Iterator[dict[str, Any]]:
    """Every schema object inside `node` (itself first), in document order, bounded."""
    budget = budget or _Budget()
    if not isinstance(node, dict) or not budget.take():
        return
    yield node
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                yield from subschemas(sub, budget)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for sub in value:
                yield from subschemas(sub, budget)
        elif key in _SCHEMA_ONE:
            yield from subschemas(value, budget)


# --- where a tool keeps its schema, in each wire format ---------------------------------------------


def _holder(tool: Any) -> tuple[dict[str, Any], str] | None:
    """(the object that holds the schema, its key): chat's `function.parameters`, Responses'
    `parameters`, Messages' `input_schema`. Server and hosted tools have none."""
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    if tool.get("type") == "function" and isinstance(function, dict):
        return (function, "parameters") if isinstance(function.get("parameters"), dict) else None
    for key in ("parameters", "input_schema"):
        if isinstance(tool.get(key), dict):
            return tool, key
    return None


def _rebuilt(tool: dict[str, Any], holder: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    if holder is tool:
        return {**tool, **changes}
    return {**tool, "function": {**holder, **changes}}


def _strict(holder: dict[str, Any]) -> bool:
    return holder.get("strict") is True


class CleanLists:
    """Tool lists known to need nothing removed, by the engines and a digest of their JSON,
    LRU-bounded.

    An agent sends the same tool list on every turn, and llama-server's rule walks every schema of
    it: about 150-270 us per Claude Code request (twelve tools, 32 KB). The fix is a function of the
    list's JSON and the engines, so a list whose walk removed nothing needs no walk the next time; a
    list that does change is worked out again each time. The JSON is the one the body's walk made
    (`ToolsJson`), or made here for llama-server's rule, where it costs a tenth of the walk. The
    digest is seeded per process; a collision could only spare the sender's own list its fix, and
    the engine's refusal then gets the one retry without constraints."""

    def __init__(self, size: int = 1024) -> None:
        self._seen: Lru[tuple[bool, bool, bytes], bool] = Lru(size)
        self._seed = int.from_bytes(os.urandom(8), "little")

    def __len__(self) -> int:
        return len(self._seen)

    def key(self, tools: list[Any], kinds: set[str], data: bytes | None) -> tuple[bool, bool, bytes] | None:
        if data is None:
            try:
                data = orjson.dumps(tools)
            except orjson.JSONEncodeError:  # nested deeper than orjson writes: walked, as without them
                return None
        return LLAMACPP in kinds, VLLM in kinds, xxhash.xxh3_128_digest(data, self._seed)

    def holds(self, key: tuple[bool, bool, bytes]) -> bool:
        return self._seen.get(key) is not None

    def add(self, key: tuple[bool, bool, bytes]) -> None:
        self._seen.put(key, True)


def fix(
    body: dict[str, Any],
    engines: Iterable[str],
    known: CleanLists | None = None,
    data: bytes | None = None,
) -> list[Note]:
    """The `tool_schemas` fix: removes from each tool's schema the keywords the preset's engines
    cannot compile (the module docstring lists them). Copy-on-write; a list that needs nothing keeps
    its bytes. `known`: the request path's lists that needed nothing; `data`: the list's JSON,
    where the body's walk made it (pipeline/walk.py)."""
    tools = body.get("tools")
    kinds = set(engines)
    if not isinstance(tools, list) or not kinds & {LLAMACPP, VLLM}:
        return []
    seen = None
    # Without the walk's JSON, serialising the list is worth it only for llama-server's rule: vLLM's
    # walks strict tools alone, and reading the list for them costs what serialising it does.
    if known is not None and (data is not None or LLAMACPP in kinds):
        seen = known.key(tools, kinds, data)
        if seen is not None and known.holds(seen):
            return []
    out: list[Any] | None = None
    dropped: list[str] = []
    budget = _Budget()
    for index, tool in enumerate(tools):
        held = _holder(tool)
        if held is None:
            continue
        holder, key = held
        schema = new = holder[key]
        if LLAMACPP in kinds:
            new = _clean(new, _llama_rule, schema, budget, dropped)
        if VLLM in kinds and _strict(holder):
            new = _clean(new, _vllm_rule, schema, budget, dropped)
        if new is not schema:
            if out is None:
                out = list(tools)
            out[index] = _rebuilt(tool, holder, {key: new})
    if out is None:
        if seen is not None and known is not None:
            known.add(seen)
        return []
    body["tools"] = out
    return [("tool_schemas", f"keywords_removed={len(dropped)}")]


# --- the one retry ---------------------------------------------------------------------------------


def refused(message: str) -> bool:
    """Whether an engine's 400 says it could not build a grammar from the request's schemas."""
    lowered = message[:2000].lower()
    return any(marker in lowered for marker in REFUSALS)


def _hinted(message: str, schema: dict[str, Any]) -> bool:
    """Whether the engine's message points into this schema: the pattern, the `$ref` or the JSON
    pointer it names (llama-server names the last two relative to the tool's parameters)."""
    values = [(m.group(1), "pattern") for m in _HINT_PATTERN.finditer(message)]
    values += [(m.group(1), "$ref") for m in _HINT_REF.finditer(message)]
    if values:  # a value is a surer sign than a pointer, which many tools may share
        return any(sub.get(key) == value for sub in subschemas(schema) for value, key in values)
    pointers = _HINT_POINTER.findall(message)
    return any(_resolves(schema, "#" + pointer) for pointer in pointers)


def _constrained(schema: dict[str, Any]) -> bool:
    return any(not CONSTRAINTS.isdisjoint(sub) for sub in subschemas(schema))


def failing_tools(tools: list[Any], engine: str, message: str) -> list[int]:
    """Which tools to send without constraints, most certain first: those the engine's message points
    into (a pattern, a `$ref`, a JSON pointer it names); else, since "failed to parse grammar" and
    vLLM's "'triggers'" name nothing, every tool the engine compiles that holds a constraint keyword
    (vLLM compiles strict tools only); else every tool the engine compiles."""
    compiled: list[tuple[int, dict[str, Any]]] = []
    for index, tool in enumerate(tools):
        held = _holder(tool)
        if held is not None and (engine != VLLM or _strict(held[0])):
            compiled.append((index, held[0][held[1]]))
    for pick in (lambda s: _hinted(message, s), _constrained, lambda s: True):
        chosen = [index for index, schema in compiled if pick(schema)]
        if chosen:
            return chosen
    return []


_ANNOTATION = "\n\nIts arguments follow this JSON Schema (not enforced for this model): "


def unconstrained(tool: dict[str, Any], engine: str) -> dict[str, Any]:
    """The tool with nothing for the engine to compile. vLLM compiles strict tools only, so the tool
    keeps its schema with `strict: false`. llama-server compiles every schema, so the tool keeps the
    names, types and descriptions of its top-level arguments, and its whole schema goes into its
    description as text for the model to follow."""
    held = _holder(tool)
    if held is None:
        return tool
    holder, key = held
    if engine == VLLM:
        return _rebuilt(tool, holder, {"strict": False})
    schema = holder[key]
    properties = schema.get("properties")
    skeleton: dict[str, Any] = {"type": "object"}
    if isinstance(properties, dict):
        skeleton["properties"] = {
            name: {
                k: v
                for k, v in sub.items()
                if (k == "type" and v in JSON_TYPES) or (k == "description" and isinstance(v, str))
            }
            if isinstance(sub, dict)
            else {}
            for name, sub in properties.items()
        }
    required = schema.get("required")
    if isinstance(required, list) and all(isinstance(name, str) for name in required):
        skeleton["required"] = required
    description = str(holder.get("description") or "") + _ANNOTATION + orjson.dumps(schema).decode()
    return _rebuilt(tool, holder, {key: skeleton, "description": description})


def loosen(body: dict[str, Any], engine: str, message: str) -> tuple[dict[str, Any], Note] | None:
    """The body to send once more after `engine` refused its tool schemas with `message`: the failing
    tools (`failing_tools`) without constraints; None when no tool can be the cause. The body given
    is left as it is."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not refused(message):
        return None
    chosen = failing_tools(tools, engine, message)
    if not chosen:
        return None
    out = list(tools)
    for index in chosen:
        out[index] = unconstrained(tools[index], engine)
    return {**body, "tools": out}, ("tool_schemas", f"unconstrained_retry={len(chosen)}")


def message_of(data: ReadBytes) -> str:
    """An engine's error message from its 400 body (OpenAI's, Anthropic's or vLLM's envelope), read
    unscrubbed: the hints `loosen` reads (a pattern, a `$ref` URL) are in it. Bounded."""
    try:
        payload = orjson.loads(data[:65536])
    except orjson.JSONDecodeError:
        return ""
    error = payload.get("error") if isinstance(payload, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    if message is None and isinstance(payload, dict):
        message = payload.get("message", payload.get("detail"))
    return message[:4000] if isinstance(message, str) else ""
