"""Tool calls a model wrote as text: found in an answer's text, whole or as it streams. Pure.

When the engine's tool parser is not set up for the model, misses a variant, or the call sits inside
a thinking block, the call reaches the client as text and the answer ends with `stop`. The forms
local models write (vLLM's and llama.cpp's parsers read the same ones):

- Hermes, Qwen 2.5 and Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- Qwen3-Coder: `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`,
  also without the `<tool_call>` wrapper; values are raw text, typed by the tool's schema;
- GLM 4.5 to 4.7: `<tool_call>NAME<arg_key>P</arg_key><arg_value>value</arg_value>...</tool_call>`;
- a bare JSON object `{"name": ..., "arguments": ...}` (or `parameters`, Llama 3's key) starting a
  line, optionally in a ```json fence: it counts only where it ends the text (prose may go before
  it, only whitespace or another call after it), since JSON in the middle of an answer is content.

A candidate becomes a call only when it is complete and names a declared tool whose schema its
arguments satisfy (tool_schema.py); anything else stays text, byte for byte. `Scanner` reads text
as it arrives and gives it back at once, except from an opening marker on (or the few characters
that may start one), so prose that names a tool streams as it comes; what it holds is bounded
(`limit`) and given back as text when no call completes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.answers.tool_schema import conforms, property_types

# Text held back while a call may be forming: a call's arguments can carry a whole file (a Write
# or apply_patch call), so this is generous; past it the text goes out as text.
MAX_HELD = 512 * 1024
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
FENCE = "```"
_MARKERS = (TOOL_CALL, FUNCTION)
# Where a call may open: an angle bracket anywhere, a brace or a fence at the start of a line.
_STARTS = re.compile(r"<|^[ \t]*[{`]", re.MULTILINE)
_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_PARTIAL = -1  # an opener may still be forming at the end of the text
_JSON_MARKS = re.compile(r'["\\{}\[\]]')  # what the brace scan of a bare JSON call reads


@dataclass(frozen=True)
class Call:
    """A complete call of a declared tool: its name and its arguments as a JSON object's text."""

    name: str
    arguments: str

    def value(self) -> dict[str, Any]:
        """The arguments as an object (they were checked to be one)."""
        value = orjson.loads(self.arguments)
        return value if isinstance(value, dict) else {}


Piece = str | Call


class Tools:
    """The tools a request declared: name -> the JSON Schema of its arguments (None: any object)."""

    def __init__(self, schemas: Mapping[str, Any]) -> None:
        self.schemas = dict(schemas)

    def __bool__(self) -> bool:
        return bool(self.schemas)

    def call(self, name: Any, arguments: Any) -> Call | None:
        """The call, when `name` is declared and `arguments` (an object, its JSON text, or nothing
        for a call without arguments) fit its schema; else None."""
        if not isinstance(name, str) or name not in self.schemas:
            return None
        if arguments is None:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments) if arguments.strip() else {}
            except orjson.JSONDecodeError:
                return None
        if not isinstance(arguments, dict) or not conforms(arguments, self.schemas[name]):
            return None
        return Call(name, orjson.dumps(arguments).decode())

    def value(self, name: str, parameter: str, raw: str) -> Any:
        """A parameter written as raw text (Qwen3-Coder, GLM) as the JSON value its schema types
        it as (the first declared type it reads as); untyped, JSON-looking text is read as JSON."""
        kinds = property_types(self.schemas.get(name), parameter)
        text = raw.strip()
        for kind in kinds:
            if kind == "string":
                return raw
            converted = _typed(kind, text)
            if converted is not _NOT:
                return converted
        if not kinds and (
            text[:1] in ("{", "[", '"') or text in ("true", "false", "null") or _NUMBER.fullmatch(text)
        ):
            try:
                return orjson.loads(text)
            except orjson.JSONDecodeError:
                return raw
        return raw  # a string, or a value the schema check refuses


_NOT = object()
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _typed(kind: str, text: str) -> Any:
    """`text` as a value of JSON type `kind`, or _NOT when it does not read as one."""
    if kind == "integer" and _INTEGER.fullmatch(text):
        return int(text)
    if kind == "number" and _NUMBER.fullmatch(text):
        return int(text) if _INTEGER.fullmatch(text) else float(text)
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind == "null" and text.lower() in ("null", "none"):
        return None
    if kind in ("object", "array") and text[:1] in ("{", "["):
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            return _NOT
        return value if isinstance(value, dict if kind == "object" else list) else _NOT
    return _NOT


# --- parsing one complete candidate -----------------------------------------------------------


def _trim(value: str) -> str:
    """One leading and one trailing newline are the template's markup, not the value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def function_block(text: str, tools: Tools) -> tuple[Call | None, int]:
    """The Qwen3-Coder call at the start of `text` (`<function=NAME>...</function>`) and the index
    just after it; (None, 0) when there is no complete, valid one."""
    if not text.startswith(FUNCTION):
        return None, 0
    close = text.find(">", len(FUNCTION))
    end = text.find(FUNCTION_END, close + 1) if close >= 0 else -1
    if end < 0:
        return None, 0
    name = text[len(FUNCTION) : close].strip()
    if not _NAME.fullmatch(name):
        return None, 0
    body = text[close + 1 : end]
    arguments: dict[str, Any] = {}
    at = 0
    while True:
        start = body.find(PARAMETER, at)
        if start < 0:
            if body[at:].strip():
                return None, 0  # text outside any parameter: not a call
            break
        if body[at:start].strip():
            return None, 0
        head = body.find(">", start)
        if head < 0:
            return None, 0
        key = body[start + len(PARAMETER) : head].strip()
        stop = body.find(PARAMETER_END, head + 1)
        following = body.find(PARAMETER, head + 1)
        # A parameter the model did not close ends where the next one opens (Qwen3-Coder does this).
        if stop < 0 or 0 <= following < stop:
            stop = following if following >= 0 else len(body)
            at = stop
        else:
            at = stop + len(PARAMETER_END)
        if not key:
            return None, 0
        arguments[key] = tools.value(name, key, _trim(body[head + 1 : stop]))
    call = tools.call(name, arguments)
    return (call, end + len(FUNCTION_END)) if call is not None else (None, 0)


def tagged(inner: str, tools: Tools) -> list[Call] | None:
    """The calls inside one `<tool_call>...</tool_call>` (its inner text), or None when it is not
    one or more complete calls of declared tools."""
    text = inner.strip()
    if text.startswith(FUNCTION):
        calls = []
        while text:
            call, used = function_block(text, tools)
            if call is None:
                return None
            calls.append(call)
            text = text[used:].strip()
        return calls
    if text.startswith("{"):
        return _json_call(text, tools)
    return _glm(text, tools)


def _json_call(text: str, tools: Tools) -> list[Call] | None:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    call = json_object_call(value, tools)
    return [call] if call is not None else None


def json_object_call(value: Any, tools: Tools) -> Call | None:
    """`{"name": ..., "arguments": ...}` (or `parameters`) as a call, or None."""
    if not isinstance(value, dict) or not set(value) <= {"name", "arguments", "parameters", "type", "id"}:
        return None
    if "arguments" in value and "parameters" in value:
        return None
    if value.get("type", "function") != "function":
        return None
    arguments = value.get("arguments", value.get("parameters"))
    return tools.call(value.get("name"), arguments)


def _glm(text: str, tools: Tools) -> list[Call] | None:
    split = text.find(ARG_KEY)
    name = (text if split < 0 else text[:split]).strip()
    if not _NAME.fullmatch(name):
        return None
    arguments: dict[str, Any] = {}
    at = len(text) if split < 0 else split
    while at < len(text):
        pair = _GLM_PAIR.match(text, at)
        if pair is None:
            return None
        key = pair.group(1).strip()
        if not key:
            return None
        arguments[key] = tools.value(name, key, pair.group(2))
        at = pair.end()
        if not text[at:].strip():
            break
    call = tools.call(name, arguments)
    return [call] if call is not None else None


# --- where a candidate opens ------------------------------------------------------------------


def json_opener(text: str, at: int) -> tuple[int, bool] | int | None:
    """Whether a bare JSON call opens at `at` (a `{` or a fence at a line's start): (the index of
    its `{`, fenced), _PARTIAL when the text ends before that is decided, or None."""
    n = len(text)
    i = at
    fenced = False
    if text[i] == "`":
        if n - i < len(FENCE):
            return _PARTIAL if FENCE.startswith(text[i:]) else None
        if not text.startswith(FENCE, i):
            return None
        i += len(FENCE)
        j = i
        while j < n and text[j].isalpha():
            j += 1
        tag = text[i:j].lower()
        if j == n:
            return _PARTIAL if "json".startswith(tag) else None
        if tag not in ("", "json"):
            return None
        while j < n and text[j] in " \t":
            j += 1
        if j == n:
            return _PARTIAL
        if text[j] != "\n":
            return None
        i = j
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i == n:
            return _PARTIAL
        if text[i] != "{":
            return None
        fenced = True
    brace = i
    i += 1
    while i < n and text[i] in " \t\r\n":
        i += 1
    rest = text[i : i + 6]
    if rest == '"name"':
        return brace, fenced
    return _PARTIAL if len(rest) < 6 and '"name"'.startswith(rest) else None


@dataclass
class _Opening:
    at: int  # where the candidate's text starts (what is held from here on)
    kind: str  # "tag", "function" or "json"
    brace: int = 0  # json: the index of its `{`
    fenced: bool = False


def find_opener(text: str, line_start: bool) -> _Opening | int | None:
    """The first opener in `text` (`line_start`: text[0] starts a line), or the index from which
    an opener may still be forming at its end (an int), or None."""
    for match in _STARTS.finditer(text):
        at = match.start()
        if text[at] == "<":
            for marker in _MARKERS:
                if text.startswith(marker, at):
                    return _Opening(at, "tag" if marker == TOOL_CALL else "function")
                if marker.startswith(text[at:]):
                    return at
            continue
        if at == 0 and not line_start:
            continue
        opened = json_opener(text, match.end() - 1)
        if opened == _PARTIAL:
            return at
        if isinstance(opened, tuple):
            return _Opening(at, "json", opened[0], opened[1])
    return None


# --- the streaming scanner --------------------------------------------------------------------


class Scanner:
    """Text in, text and calls out: `feed` each piece of an answer's text as it arrives, `end` once
    it is over. The text given back, joined, is the input without its calls (and without the
    whitespace after the last call); nothing is held but a candidate call, the characters that may
    open one and the whitespace after a call, up to `limit` characters in all."""

    def __init__(self, tools: Tools, limit: int = MAX_HELD) -> None:
        self.tools = tools
        self.limit = limit
        self.held = ""
        self.opening: _Opening | None = None
        self.line_start = True  # held[0] sits at the start of a line
        self.searched = 0  # how far a candidate's closing marker or brace was looked for
        self.depth = 0  # json: the brace scan's state, kept between feeds
        self.in_string = False
        self.escape_at = -1  # json: the index of the character a backslash escapes
        self.json_end: int | None = None  # json: where the object ends, once read
        # While a candidate waits for its end, what arrives is kept aside and joined once, when the
        # end may be there: a call fed a token at a time must not cost quadratic time.
        self.waiting: list[str] = []
        self.waiting_size = 0
        self.tail = ""  # the last characters read, where a closing marker may have begun
        self.after_call = False  # a call was found: whitespace after it waits for what follows
        self.gap = ""  # that whitespace, while a candidate after it is read
        self.tentative: list[tuple[str, Call]] = []  # bare JSON calls (and their text) that must end it
        self.calls = 0  # calls given out

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if not text:
            return out
        if self.opening is not None and not self._ready(text):
            return out
        self._join(text)
        self._run(out, final=False)
        return out

    def end(self) -> list[Piece]:
        out: list[Piece] = []
        self._join("")
        self._run(out, final=True)
        if self.tentative:
            self._confirm(out)
        if self.held.strip() or not self.after_call:
            self._text(out, self.held)
        self.held = ""
        return out

    # --- states ---

    def _run(self, out: list[Piece], final: bool) -> None:
        while self.held:
            progressed = self._candidate(out, final) if self.opening else self._idle(out, final)
            if not progressed:
                return

    def _idle(self, out: list[Piece], final: bool) -> bool:
        held = self.held
        if self.after_call or self.tentative:
            return self._after(out, final)
        opened = find_opener(held, self.line_start)
        if isinstance(opened, _Opening):
            self._text(out, held[: opened.at])
            self.held = held[opened.at :]
            return self._open(opened)
        if isinstance(opened, int) and not final:
            self._text(out, held[:opened])
            self.held = held[opened:]
            return False
        self._text(out, held)
        self.held = ""
        return False

    def _after(self, out: list[Piece], final: bool) -> bool:
        """After a call: whitespace waits; another call may follow; anything else is text (and the
        bare JSON calls before it were content after all)."""
        held = self.held
        body = held.lstrip()
        gap = held[: len(held) - len(body)]
        if not body and len(held) <= self.limit:
            return False  # only whitespace so far: it may end the text
        opened = find_opener(body, True) if body else None
        if isinstance(opened, _Opening) and opened.at == 0:
            if opened.kind != "json" and self.tentative:
                self._confirm(out)  # a tagged call follows: the bare ones ended the text
            self.held, self.gap = body, gap
            return self._open(opened)
        if opened == 0 and not final and len(held) <= self.limit:
            return False  # an opener may be forming right after the call
        self.held = body
        self._text(out, self._reverted() + gap)
        return True

    def _open(self, opening: _Opening) -> bool:
        self.opening = opening
        opening.brace -= opening.at
        opening.at = 0
        self.searched = opening.brace if opening.kind == "json" else 0
        self.depth, self.in_string, self.escape_at, self.json_end = 0, False, -1, None
        self.tail = ""
        return True

    def _ready(self, text: str) -> bool:
        """Whether `text`, arriving while a candidate waits, may end it (or the wait is too long);
        if not, it is kept aside, read already."""
        opening = self.opening
        assert opening is not None
        if opening.kind == "json":
            if self.json_end is None:
                self.json_end = self._scan(text, len(self.held) + self.waiting_size)
            ready = self.json_end is not None
        else:
            close = TOOL_CALL_END if opening.kind == "tag" else FUNCTION_END
            window = self.tail + text
            ready = close in window
            self.tail = window[-len(close) :]
        if ready or len(self.held) + self.waiting_size + len(text) > self.limit:
            return True
        self.waiting.append(text)
        self.waiting_size += len(text)
        return False

    def _join(self, text: str) -> None:
        if self.waiting:
            self.held += "".join(self.waiting)
            self.waiting.clear()
            self.waiting_size = 0
        self.held += text

    def _scan(self, text: str, base: int) -> int | None:
        """Reads `text` (the held text from index `base` on) for the end of the JSON object being
        read: the index just after its closing brace, or None; the state is kept between calls."""
        for match in _JSON_MARKS.finditer(text):
            at = base + match.start()
            if at == self.escape_at:
                continue
            char = match.group()
            if self.in_string:
                if char == "\\":
                    self.escape_at = at + 1
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return at + 1
        self.searched = base + len(text)
        return None

    def _candidate(self, out: list[Piece], final: bool) -> bool:
        opening = self.opening
        assert opening is not None
        if opening.kind == "json":
            return self._json(out, opening, final)
        close = TOOL_CALL_END if opening.kind == "tag" else FUNCTION_END
        end = self.held.find(close, max(0, self.searched - len(close)))
        if end < 0:
            self.searched = len(self.held)
            self.tail = self.held[-len(close) :]
            if not final:
                return self._bounded(out)
            inner = self.held[len(TOOL_CALL) :].rstrip()
            if opening.kind == "tag" and (inner.endswith(FUNCTION_END) or inner.endswith("}")):
                # Models stop right after the call at times, without the closing tag.
                calls = tagged(inner, self.tools)
                if calls:
                    return self._found(out, calls, len(self.held))
            return self._drop(out, len(self.held))
        stop = end + len(close)
        if opening.kind == "tag":
            calls = tagged(self.held[len(TOOL_CALL) : end], self.tools)
        else:
            call, _ = function_block(self.held[:stop], self.tools)
            calls = [call] if call is not None else None
        if not calls:
            return self._drop(out, stop)
        return self._found(out, calls, stop)

    def _json(self, out: list[Piece], opening: _Opening, final: bool) -> bool:
        held = self.held
        if self.json_end is None and self.searched < len(held):
            self.json_end = self._scan(held[self.searched :], self.searched)
        end = self.json_end
        if end is None:
            return self._drop(out, len(held)) if final else self._bounded(out)
        stop = end
        if opening.fenced:
            closing = held[end:].lstrip()
            if not final and len(closing) < len(FENCE) and FENCE.startswith(closing):
                return self._bounded(out)  # the fence may be closing: wait for it
            if closing.startswith(FENCE):
                stop = len(held) - len(closing) + len(FENCE)
            elif closing or not final:
                return self._drop(out, end)
        try:
            value = orjson.loads(held[opening.brace : end])
        except orjson.JSONDecodeError:
            value = None
        call = json_object_call(value, self.tools)
        if call is None:
            return self._drop(out, stop)
        self.tentative.append((self.gap + held[:stop], call))
        self.gap = ""
        self.held = held[stop:]
        self.opening = None
        return True

    # --- outcomes ---

    def _found(self, out: list[Piece], calls: list[Call], stop: int) -> bool:
        if self.tentative:
            self._confirm(out)
        out.extend(calls)
        self.calls += len(calls)
        self.held = self.held[stop:]
        self.opening = None
        self.gap = ""
        self.after_call = True
        self.line_start = True
        return True

    def _confirm(self, out: list[Piece]) -> None:
        out.extend(call for _, call in self.tentative)
        self.calls += len(self.tentative)
        self.tentative.clear()
        self.after_call = True

    def _reverted(self) -> str:
        """The text of the bare JSON calls held so far (they did not end the text) and of the
        whitespace before the candidate now read."""
        text = "".join(raw for raw, _ in self.tentative) + self.gap
        self.tentative.clear()
        self.gap = ""
        self.after_call = False
        return text

    def _drop(self, out: list[Piece], stop: int) -> bool:
        """Not a call: its text goes out as text, and scanning goes on after it."""
        self._text(out, self._reverted() + self.held[:stop])
        self.held = self.held[stop:]
        self.opening = None
        return True

    def _bounded(self, out: list[Piece]) -> bool:
        """Waiting for more; past the limit the candidate is text."""
        size = len(self.held) + self.waiting_size + len(self.gap) + sum(len(raw) for raw, _ in self.tentative)
        if size > self.limit:
            self._drop(out, len(self.held))
        return False

    def _text(self, out: list[Piece], text: str) -> None:
        if not text:
            return
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)
        self.line_start = text.endswith("\n")
        self.after_call = False


def split(text: str, tools: Tools, limit: int = MAX_HELD) -> tuple[str, list[Call]]:
    """A whole answer's text: (the text without its calls, the calls), as a stream would give them."""
    scanner = Scanner(tools, limit)
    pieces = scanner.feed(text) + scanner.end()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, Call)]
