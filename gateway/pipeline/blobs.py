"""Large string values (base64 images) are set aside, not parsed: the gateway never reads them.

A 32 MiB image request parsed and re-serialised whole holds the GIL for tens of milliseconds at a
time, and a worker thread does not help: orjson never releases it, so the event loop stalls for
every other request. Instead the long `"data:..."` literals are cut out of the raw bytes and
replaced by short placeholders before parsing, and their original bytes are put back, unchanged,
when the body is serialised for the replica. What remains to parse is a few kilobytes.

Only string literals that need no unescaping are set aside (no backslash inside), so the bytes put
back are exactly what the client sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Anything shorter is parsed as usual: it costs less than finding it.
MIN_BLOB = 64 * 1024
_START = b'"data:'


@dataclass
class Blobs:
    originals: list[memoryview] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.originals)


def placeholder(index: int) -> bytes:
    # NUL bytes make a collision with a client's own text practically impossible; orjson writes
    # them as \u0000, which is how they are found again in the serialised body.
    return b'"\\u0000fleet-gateway-blob-%d\\u0000"' % index


def set_aside(raw: bytes | bytearray) -> tuple[bytes | bytearray, Blobs]:
    """The raw body with each long `"data:` string literal replaced by a placeholder."""
    blobs = Blobs()
    if len(raw) < MIN_BLOB:
        return raw, blobs
    view = memoryview(raw)
    parts: list[bytes | memoryview] = []
    position = 0
    while True:
        start = raw.find(_START, position)
        if start < 0:
            break
        end = raw.find(b'"', start + 1)
        if end < 0:
            break
        end += 1
        if end - start < MIN_BLOB or raw.find(b"\\", start, end) >= 0:
            position = end
            continue
        parts.append(view[position:start])
        parts.append(placeholder(len(blobs.originals)))
        blobs.originals.append(view[start:end])
        position = end
    if not blobs:
        return raw, blobs
    parts.append(view[position:])
    return b"".join(parts), blobs


def put_back(serialised: bytes, blobs: Blobs) -> bytes:
    """The serialised body with every placeholder replaced by the original bytes it stood for.

    A placeholder the rewrite dropped (a duplicate key collapses to its last value) is skipped.
    """
    if not blobs:
        return serialised
    found = []
    for index, original in enumerate(blobs.originals):
        marker = placeholder(index)
        at = serialised.find(marker)
        if at >= 0:
            found.append((at, len(marker), original))
    parts: list[bytes | memoryview] = []
    position = 0
    for at, length, original in sorted(found, key=lambda item: item[0]):
        parts.append(serialised[position:at])
        parts.append(original)
        position = at + length
    parts.append(serialised[position:])
    return b"".join(parts)
