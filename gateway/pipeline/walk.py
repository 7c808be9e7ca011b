"""One walk over a parsed request body, for what every request needs to know of all of it.

Three questions cover the whole body: is it nested deeper than the gateway's limit, does it hold a
float as large as an integer orjson could not hold (body.py then looks for the digits), and how
long is its prompt text (the token estimate). Asked one at a time they cost three passes; on a
50 KB Claude Code request the passes cost more than orjson's parse itself (measured: 35 us for the
depth, 43 for a byte scan for long digits, 35 for counting brackets, 65 for the estimate; this
walk answers all three in about the time of the estimate alone).

Two more ride along, for checks that would each read the whole history again: does any part of
the prompt name an image type, and does any dict of it hold a `type` that is not a string. Routing
(vision) and the tool-result image step scan every turn for image parts, and each dialect's check
reads every part's type; where the walk saw neither, those scans cannot find anything, and do not
run (a 300-turn history: the scans cost 1.66 M and 0.80 M instructions, the questions 0.37 M and
0.02 M more in the walk).

Level by level, without recursion (the depth check cannot hit the recursion limit it guards
against) and without a tuple per node (on a 64 KB chat body: 44 us with tuples, 19 us so).

The walk reads every value, as the depth check always did: the body's size limit bounds it (the
estimate alone used to stop after a million values). Its worst case is a body of numbers, and a long
list is read by its elements' types first, at C speed: a 28 MiB body of 15 million integers parses
in 0.64 s of CPU, against 0.71 s for the parse, the byte scans and the bounded estimate before.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import orjson
import xxhash

from gateway.dialects.openai import IMAGE_PART_TYPES
from gateway.lru import Lru

# Where a prompt's text lives in the three dialects' bodies; what is under other keys (sampling
# settings, image data) does not become prompt tokens in proportion to its length.
PROMPT_KEYS = frozenset({"messages", "system", "prompt", "input", "instructions", "tools", "functions"})
SKIP_KEYS = frozenset({"image_url", "url", "data", "image", "input_image", "file_data", "source"})
# orjson turns an integer beyond 64 bits into a float of at least this size (2**63 for a negative
# one, 2**64 for a positive one); a float of that size may also be one the client wrote as a float.
BIG_FLOAT = 2.0**63
# A longer list is first read by its elements' types, at C speed: a list of numbers (token ids,
# vectors) holds no text, no container and, but for a float that large, nothing the walk looks for.
LONG_LIST = 64
_NUMBERS = frozenset({int, float, bool})


class ToolsJson(NamedTuple):
    """A request's tool list and its JSON, serialised once: the steps after the walk that hash the
    list (the tool-schema fix's known lists, the prefix fingerprint) read these bytes while the body
    still holds this very list (every step replaces a list it changes, never edits it)."""

    tools: list[Any]
    data: bytes

    def of(self, tools: Any) -> bytes | None:
        """The JSON of `tools` when it is this list, else None (serialise it again)."""
        return self.data if tools is self.tools else None


class BodyFacts(NamedTuple):
    too_deep: bool  # nested deeper than the limit (the walk stopped there: the rest is not counted)
    big_float: bool  # a float of at least BIG_FLOAT: maybe an integer beyond 64 bits
    prompt_chars: int  # characters of prompt text: strings under PROMPT_KEYS, not under SKIP_KEYS
    tools_json: ToolsJson | None = None  # the body's tool list serialised, when the walk did it
    # A dict of the prompt text whose "type" names an image part: True also where not looked for.
    # Every image part a scan looks for (dialects' has_images, tool_results.tool_images) is such a
    # dict, so False means no scan would find one.
    image_parts: bool = True
    # ... whose "type" is neither a string nor null: what base.part_types refuses in a part.
    odd_types: bool = True

    @property
    def estimated_tokens(self) -> int:
        """Four characters a token: close for English and code, low for CJK text (the engine's own
        400 then confirms a prompt that is too long)."""
        return self.prompt_chars // 4


class KnownTools:
    """The walk's facts about the tool lists it has read, by the depth limit and a digest of their
    JSON, LRU-bounded.

    An agent sends the same tools on every turn, and they are most of what the walk reads: Claude
    Code's twelve tools (32 KB) cost 45 of the walk's 58 us on its captured request, serialising and
    hashing them 12. The digest is keyed with a seed drawn per process, so a client cannot aim a
    list at another's facts; a collision could only mislead the walk about the sender's own body."""

    def __init__(self, size: int = 1024) -> None:
        self._facts: Lru[tuple[int, bytes], BodyFacts] = Lru(size)
        self._seed = int.from_bytes(os.urandom(8), "little")

    def __len__(self) -> int:
        return len(self._facts)

    def facts(self, tools: list[Any], max_depth: int) -> BodyFacts:
        """The facts of `{"tools": tools}`, what the list adds to its body's, with its JSON."""
        try:
            data = orjson.dumps(tools)
        except orjson.JSONEncodeError:  # nested deeper than orjson writes (254 levels)
            return _walk({"tools": tools}, max_depth)
        key = (max_depth, xxhash.xxh3_128_digest(data, self._seed))
        found = self._facts.get(key)
        if found is None:
            found = _walk({"tools": tools}, max_depth)
            self._facts.put(key, found)
        return found._replace(tools_json=ToolsJson(tools, data))


def walk(body: dict[str, Any], max_depth: int, known: KnownTools | None = None) -> BodyFacts:
    """The facts of a parsed body (the top level is depth 1); with `known`, a tool list read before
    is not read again. Whether it is too deep: the same either way; the rest the same unless it is
    (the walk then stops where it is, and the body is refused)."""
    tools = body.get("tools")
    if known is None or type(tools) is not list or not tools:
        return _walk(body, max_depth)
    rest = _walk(body, max_depth, skip="tools")
    listed = known.facts(tools, max_depth)
    return BodyFacts(
        rest.too_deep or listed.too_deep,
        rest.big_float or listed.big_float,
        rest.prompt_chars + listed.prompt_chars,
        listed.tools_json,
        rest.image_parts or listed.image_parts,
        rest.odd_types or listed.odd_types,
    )


def _walk(body: dict[str, Any], max_depth: int, skip: str | None = None) -> BodyFacts:
    """The walk itself, leaving out the top-level key `skip`. Exact types are compared, as the JSON
    parsers make them: cheaper than isinstance."""
    chars = 0
    big = False
    images = False
    odd = False
    text: list[Any] = []  # containers whose strings are prompt text
    other: list[Any] = []  # containers whose strings are not
    for key, child in body.items():
        if key == skip:
            continue
        kind = type(child)
        if kind is dict or kind is list:
            (text if key in PROMPT_KEYS else other).append(child)
        elif kind is str:
            if key in PROMPT_KEYS:
                chars += len(child)
        elif kind is float and not -BIG_FLOAT < child < BIG_FLOAT:
            big = True
    depth = 2
    while text or other:
        if depth > max_depth:
            return BodyFacts(True, big, chars, None, images, odd)
        text_below: list[Any] = []
        other_below: list[Any] = []
        for node in text:
            if type(node) is list:
                if len(node) > LONG_LIST and (numbers := _numbers(node)) is not None:
                    big = big or numbers
                    continue
                for child in node:
                    kind = type(child)
                    if kind is str:
                        chars += len(child)
                    elif kind is dict or kind is list:
                        text_below.append(child)
                    elif kind is float and not -BIG_FLOAT < child < BIG_FLOAT:
                        big = True
            else:
                for key, child in node.items():
                    kind = type(child)
                    if kind is str:
                        if key not in SKIP_KEYS:
                            chars += len(child)
                            # On the strings already in hand: a get per dict cost twice as much.
                            if key == "type" and child in IMAGE_PART_TYPES:
                                images = True
                    else:
                        if key == "type" and child is not None:
                            odd = True
                        if kind is dict or kind is list:
                            (other_below if key in SKIP_KEYS else text_below).append(child)
                        elif kind is float and not -BIG_FLOAT < child < BIG_FLOAT:
                            big = True
        for node in other:
            if type(node) is list and len(node) > LONG_LIST and (numbers := _numbers(node)) is not None:
                big = big or numbers
                continue
            for child in node.values() if type(node) is dict else node:
                kind = type(child)
                if kind is dict or kind is list:
                    other_below.append(child)
                elif kind is float and not -BIG_FLOAT < child < BIG_FLOAT:
                    big = True
        text, other = text_below, other_below
        depth += 1
    return BodyFacts(False, big, chars, None, images, odd)


def _numbers(node: list[Any]) -> bool | None:
    """For a list of numbers only: whether it holds a float at least BIG_FLOAT in size (where it
    holds floats, its largest number is compared: an integer that large is within 64 bits, and only
    makes body.py look at the digits); None for any other list, which the walk then reads element by
    element."""
    kinds = set(map(type, node))
    if not kinds <= _NUMBERS:
        return None
    return float in kinds and max(map(abs, node)) >= BIG_FLOAT
