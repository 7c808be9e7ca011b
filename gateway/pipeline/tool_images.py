"""The `tool_images` step: an image inside a tool result reaches a model that can use it.

A text-only model never sees an image an agent's tool returned (a screenshot `Read` by Claude
Code, Codex's `view_image`): engines and templates drop it silently or refuse the request, and the
agent replays the same item on every later turn. So, before the request goes up
(dialects/tool_results.py has the shapes and what each engine accepts):

- on a preset with `vision: true`, the image moves to a user turn right after its tool result,
  where every engine reads images;
- otherwise the table's vision preset (`routing.images`) describes it, through the gateway's own
  request path (the `describe` callable the proxy is given): the text transcribed exactly and the
  layout described, put where the image was. Descriptions are kept by the image's digest in a
  bounded cache, so a history that replays the image is not described again;
- with no vision preset, a short text says an image was there and could not be shown.

Only inline images (`data:` URLs) are described: the gateway opens no URL a client sends. A long
image string may arrive set aside by the body reader (pipeline/blobs.py): its placeholder is
resolved to the original bytes here, and the bytes put back unchanged when the image is moved.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.dialects.base import Note
from gateway.dialects.tool_results import move_images, replace_images, tool_images
from gateway.lru import Lru
from gateway.pipeline.blobs import Blobs

# (the image as a data: URL, the instruction) -> the vision preset's answer text.
Describe = Callable[[str, str], Awaitable[str]]

INSTRUCTION = (
    "This image was returned by a tool to a coding agent that cannot see images. Transcribe every "
    "piece of text in it exactly, line by line, keeping code, numbers and error messages verbatim. "
    "Then describe its layout briefly: what kind of image it is, where things are, and any chart, "
    "diagram or UI state that the text alone does not say."
)
DESCRIBED = "[Image from the tool result, described by the gateway's vision model]\n"
NO_VISION = (
    "[The tool returned an image here. This model cannot see images and the gateway has no vision "
    "model configured to describe it.]"
)
NOT_INLINE = "[The tool returned an image by URL here; the gateway describes inline images only.]"
FAILED = "[The tool returned an image here; the gateway's vision model could not describe it.]"
MAX_DESCRIPTION = 8_000  # characters kept of one description
CACHE_ENTRIES = 512
MAX_IMAGES = 16  # described per request; the rest get FAILED's text (bounded work per request)
_PLACEHOLDER = re.compile(r"^\x00fleet-gateway-blob-(\d+)\x00$")
_HASH_ON_THREAD = 1 << 20  # hashlib releases the GIL on large inputs


class Descriptions(Lru[str, str]):
    """Descriptions by image digest, the least recently used dropped first (bounded memory)."""

    def __init__(self, entries: int = CACHE_ENTRIES) -> None:
        super().__init__(entries)


def resolve(url: str, blobs: Blobs) -> str:
    """The image's URL as the client sent it: a set-aside string's original bytes."""
    found = _PLACEHOLDER.match(url)
    if found is None or not blobs:
        return url
    index = int(found.group(1))
    if index >= len(blobs.originals):
        return url
    # The original is the JSON literal with its quotes, and holds no backslash (blobs.set_aside).
    return bytes(blobs.originals[index][1:-1]).decode("utf-8", "replace")


async def digest(data: str) -> str:
    raw = data.encode()
    if len(raw) >= _HASH_ON_THREAD:
        return await asyncio.to_thread(lambda: hashlib.sha256(raw).hexdigest())
    return hashlib.sha256(raw).hexdigest()


class ToolImages:
    """The step: `apply` changes a request body (the rewrite's copy) for its preset."""

    def __init__(self, describe: Describe | None, cache: Descriptions | None = None) -> None:
        self.describe = describe
        self.cache = cache if cache is not None else Descriptions()

    async def apply(
        self, body: dict[str, Any], blobs: Blobs, *, vision: bool, can_describe: bool
    ) -> list[Note]:
        """`vision`: the preset takes images; `can_describe`: the table has a vision preset."""
        found = tool_images(body)
        if not found:
            return []
        if vision:
            moved = move_images(body)
            return [("tool_images", f"moved={moved}")] if moved else []
        if not can_describe or self.describe is None:
            replaced = replace_images(body, dict.fromkeys(found, NO_VISION))
            return [("tool_images", f"placeholder={replaced}")]
        texts, described, cached = await self._texts(found, blobs)
        replace_images(body, texts)
        return [("tool_images", f"described={described},cached={cached}")]

    async def _texts(self, found: list[str], blobs: Blobs) -> tuple[dict[str, str], int, int]:
        texts: dict[str, str] = {}
        described = cached = 0
        for url in dict.fromkeys(found):  # each distinct image once, in order
            data = resolve(url, blobs)
            if not data.startswith("data:"):
                texts[url] = NOT_INLINE
                continue
            key = await digest(data)
            known = self.cache.get(key)
            if known is not None:
                texts[url], cached = known, cached + 1
                continue
            if described >= MAX_IMAGES:
                texts[url] = FAILED
                continue
            described += 1
            text = await self._describe(data)
            if text is None:
                texts[url] = FAILED  # not cached: the next turn may find the vision preset back
                continue
            texts[url] = DESCRIBED + text[:MAX_DESCRIPTION]
            self.cache.put(key, texts[url])
        return texts, described, cached

    async def _describe(self, data: str) -> str | None:
        assert self.describe is not None
        try:
            text = await self.describe(data, INSTRUCTION)
        except asyncio.CancelledError:
            raise
        except Exception:  # the vision preset is down or refused: the request goes on without it
            return None
        return text.strip() or None
