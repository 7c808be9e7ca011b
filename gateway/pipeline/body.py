"""Reading and parsing a client's request body, within the limits that keep the gateway alive.

orjson is strict RFC 8259: it refuses NaN, Infinity, 1e999, lone surrogates and invalid UTF-8
at the parser, so none of them can be re-emitted upstream as invalid JSON. Depth is checked here
because CPython's own limit (~1000) would surface as a RecursionError, i.e. a 500.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any, NamedTuple

import orjson

from gateway.errors import BadRequest, RequestTimeout, RequestTooLarge, UnsupportedMediaType
from gateway.pipeline.blobs import Blobs, set_aside
from gateway.pipeline.walk import BodyFacts, KnownTools, ToolsJson, walk
from gateway.settings import Settings
from gateway.types import Receive


async def read_request(
    receive: Receive, headers: dict[str, str], settings: Settings, arrived: bool = False
) -> bytes | bytearray:
    """The request's body as the client meant it: read within the size and time limits, then
    inflated when it came compressed (on a worker thread when large). `arrived`: the connection
    has the whole body already (no wait, so no timer). Raises ClientGone when the client leaves,
    a GatewayError when the body breaks a limit."""
    length = headers.get("content-length")
    raw = await read_body(
        receive,
        int(length) if length and length.isdigit() else None,
        settings.max_body_bytes,
        None if arrived else settings.body_timeout,
    )
    encoding = headers.get("content-encoding", "")
    if not encoding:
        return raw
    # Inflating megabytes holds the loop as parsing them would: same threshold, same thread.
    if len(raw) * 8 > settings.offload_bytes:
        return await asyncio.to_thread(decompress, raw, encoding, settings.max_body_bytes)
    return decompress(raw, encoding, settings.max_body_bytes)


class Parsed(NamedTuple):
    body: dict[str, Any]
    blobs: Blobs  # long strings set aside (large bodies)
    tokens: int  # the prompt's tokens as estimated (walk.py)
    tools_json: ToolsJson | None  # the body's tool list as the walk serialised it, if it did
    image_parts: bool  # whether the body may hold an image part (walk.py's BodyFacts)
    odd_types: bool  # whether a part's type may be neither a string nor null (likewise)


async def parse(raw: bytes | bytearray, settings: Settings, known: KnownTools | None = None) -> Parsed:
    """The body as a JSON object, its long strings set aside, its prompt tokens as estimated (walk.py,
    with the tool lists read before: `known`) and its tool list's JSON; large bodies on a worker
    thread, which reads them whole (the cache belongs to the event loop's thread)."""
    if len(raw) > settings.offload_bytes:
        body, blobs, tokens = await asyncio.to_thread(parse_large, raw, settings.max_json_depth)
        return Parsed(body, blobs, tokens, None, True, True)  # not looked for: the scans run
    body, facts = read_walked(raw, settings.max_json_depth, known)
    return Parsed(body, Blobs(), facts.estimated_tokens, facts.tools_json, facts.image_parts, facts.odd_types)


async def read_body(
    receive: Receive, content_length: int | None, limit: int, timeout: float | None
) -> bytes | bytearray:
    """The whole body, or a 413 without reading it when Content-Length already says it is too big;
    a 408 when it takes longer than `timeout` (None: it is known to be there already).

    A body in several pieces is gathered into one bytearray as the pieces come, never joined at
    the end: joining 32 MiB at once holds the event loop for tens of milliseconds. Everything
    downstream (orjson, blobs.set_aside) reads a bytearray as it reads bytes.
    """
    if content_length is not None and content_length > limit:
        raise _too_large(limit)
    if timeout is None:
        return await _gather(receive, limit)
    try:
        async with asyncio.timeout(timeout):
            return await _gather(receive, limit)
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout:g} s") from None


async def _gather(receive: Receive, limit: int) -> bytes | bytearray:
    first: bytes | None = None
    gathered: bytearray | None = None
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            if first is None:
                first = chunk
            else:
                if gathered is None:
                    gathered = bytearray(first)
                gathered += chunk
        if not message.get("more_body", False):
            break
    if gathered is not None:
        return gathered
    return first if first is not None else b""


# A JSON request compresses 5-20x (base64 images barely at all); far beyond that is a bomb.
MAX_RATIO = 100
# zlib's window bits: gzip framing, or zlib (RFC 1950) / raw deflate (RFC 1951) for "deflate".
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decompress(raw: bytes | bytearray, encoding: str, limit: int) -> bytes | bytearray:
    """A `Content-Encoding: gzip|deflate` body inflated, within `limit` bytes and MAX_RATIO.

    Inflated in bounded steps, so a bomb stops at the cap instead of filling memory first.
    """
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in WBITS:
        raise UnsupportedMediaType(
            f"Content-Encoding '{encoding[:32]}' is not supported; "
            "send gzip, deflate or an uncompressed body",
            code="unsupported_content_encoding",
        )
    cap = min(limit, max(len(raw), 1) * MAX_RATIO)
    try:
        out = _inflate(raw, WBITS[encoding], cap)
    except zlib.error:
        if encoding != "deflate":
            raise BadRequest("The request body is not valid gzip data", code="invalid_encoding") from None
        try:  # "deflate" is sent both with and without the zlib header
            out = _inflate(raw, -zlib.MAX_WBITS, cap)
        except zlib.error:
            raise BadRequest("The request body is not valid deflate data", code="invalid_encoding") from None
    return out


def _inflate(raw: bytes | bytearray, wbits: int, cap: int) -> bytearray:
    inflater = zlib.decompressobj(wbits)
    out = bytearray()
    view = memoryview(raw)
    step = 1 << 20
    for start in range(0, len(view), step):
        out += inflater.decompress(view[start : start + step], cap + 1 - len(out))
        if len(out) > cap or inflater.unconsumed_tail:
            raise _inflated_too_large(cap)
    out += inflater.flush()
    if len(out) > cap:
        raise _inflated_too_large(cap)
    if not inflater.eof:
        raise zlib.error("truncated")
    return out


def _inflated_too_large(cap: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"The decompressed request body is larger than {cap} bytes (the body limit, or {MAX_RATIO}x "
        "its compressed size)"
    )


class ClientGone(Exception):
    """The client left before its request was read."""


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"The request body is larger than the limit of {limit} bytes")


# orjson reads integers within 64 bits (signed or unsigned) and turns larger ones into floats;
# any such integer has at least 19 digits (-2**63 - 1), so only bodies with such a run (and such a
# float, see walk.py) take the slow path.
# Looked for with bytes.translate and a substring search, not a regex: `\d{19}` costs the regex
# engine a try at every byte (measured: 5 us on a 400-byte body, 0.5 ms on 40 KB; this, 0.7 us and
# 38 us). Large bodies in slices, so the translated copy stays small.
_DIGITS_ONLY = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
_LONG_RUN = b"0" * 19
_SLICE = 1 << 20


def long_digits(raw: bytes | bytearray) -> bool:
    """Whether the body holds a run of 19 or more digits (an integer orjson cannot hold exactly)."""
    if len(raw) <= _SLICE:
        return _LONG_RUN in raw.translate(_DIGITS_ONLY)
    for start in range(0, len(raw), _SLICE):
        # Each slice begins 18 bytes early: a run across the boundary is seen whole.
        if _LONG_RUN in raw[max(0, start - 18) : start + _SLICE].translate(_DIGITS_ONLY):
            return True
    return False


INT_RANGE = range(-(2**63), 2**64)


def _exact_int(text: str) -> int | orjson.Fragment:
    value = int(text)
    # Beyond orjson's range it stays the client's own digits, forwarded byte for byte.
    return value if value in INT_RANGE else orjson.Fragment(text)


def read_object(raw: bytes | bytearray, max_depth: int) -> tuple[dict[str, Any], int]:
    """The body as a JSON object within the depth limit, and its prompt tokens as estimated."""
    body, facts = read_walked(raw, max_depth)
    return body, facts.estimated_tokens


def read_walked(
    raw: bytes | bytearray, max_depth: int, known: KnownTools | None = None
) -> tuple[dict[str, Any], BodyFacts]:
    """The body as a JSON object within the depth limit, and what its walk found."""
    if not raw:
        raise BadRequest("The request body is empty; send a JSON object", code="invalid_json")
    try:
        body = orjson.loads(raw)  # also the strict check (NaN, lone surrogates, bad UTF-8) for both paths
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {_reason(exc)}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object", code="invalid_json")
    facts = walk(body, max_depth, known)
    if facts.too_deep:
        raise BadRequest(f"The request body is nested deeper than {max_depth} levels", code="json_too_deep")
    # Only a body that holds such a float can have had an integer orjson could not hold: its
    # digits are looked for, and found ones parsed again, exactly (the values are the same).
    if facts.big_float and long_digits(raw):
        # New objects: the tool list's JSON stays with the list it was made of, not this one.
        body = json.loads(raw, parse_int=_exact_int)
    return body, facts


def parse_large(raw: bytes | bytearray, max_depth: int) -> tuple[dict[str, Any], Blobs, int]:
    """For big bodies, on a worker thread: long data: literals set aside, the rest parsed."""
    skeleton, blobs = set_aside(raw)
    body, tokens = read_object(skeleton, max_depth)
    return body, blobs, tokens


def _reason(exc: orjson.JSONDecodeError) -> str:
    # orjson's message names the position and the problem, never echoes the input.
    return str(exc).split(":", 1)[0][:120]
