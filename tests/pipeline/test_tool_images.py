"""The `tool_images` step: a vision preset gets the image moved, a text-only preset its
description (described once, then from the bounded cache), a table without a vision preset a
placeholder; long images set aside by the body reader are described from their original bytes."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from gateway.pipeline.blobs import Blobs, put_back, set_aside
from gateway.pipeline.body import parse_large
from gateway.pipeline.tool_images import DESCRIBED, FAILED, NO_VISION, NOT_INLINE, Descriptions, ToolImages
from tests.dialects.test_tool_results import URL, chat_body, responses_body


class Describer:
    """Stands in for the vision preset: records what it was asked."""

    def __init__(self, answer: str = "a login form with the text 'Sign in'", fail: bool = False) -> None:
        self.asked: list[tuple[str, str]] = []
        self.answer = answer
        self.fail = fail

    async def __call__(self, image: str, instruction: str) -> str:
        self.asked.append((image, instruction))
        if self.fail:
            raise RuntimeError("the vision preset is down")
        return self.answer


def run(
    step: ToolImages, body: dict[str, Any], blobs: Blobs | None = None, **kw: bool
) -> list[tuple[str, str]]:
    return asyncio.run(step.apply(body, blobs or Blobs(), **kw))


def texts(body: dict[str, Any]) -> str:
    return orjson.dumps(body).decode()


def test_a_text_only_preset_gets_the_vision_presets_description_once() -> None:
    describe = Describer()
    step = ToolImages(describe)
    first = responses_body()
    assert run(step, first, vision=False, can_describe=True) == [("tool_images", "described=1,cached=0")]
    assert describe.asked[0][0] == URL and "Transcribe" in describe.asked[0][1]
    assert (
        DESCRIBED.strip() in texts(first) and "Sign in" in texts(first) and "input_image" not in texts(first)
    )
    replayed = responses_body()  # the next turn replays the same image
    assert run(step, replayed, vision=False, can_describe=True) == [("tool_images", "described=0,cached=1")]
    assert len(describe.asked) == 1 and first["input"] == replayed["input"]


def test_a_vision_preset_gets_the_image_moved_not_described() -> None:
    describe = Describer()
    body = responses_body()
    assert run(ToolImages(describe), body, vision=True, can_describe=True) == [("tool_images", "moved=1")]
    assert describe.asked == [] and body["input"][3]["content"][1]["image_url"] == URL


def test_without_a_vision_preset_the_image_becomes_a_placeholder() -> None:
    body = chat_body()
    assert run(ToolImages(None), body, vision=False, can_describe=False) == [("tool_images", "placeholder=1")]
    assert NO_VISION in texts(body)


def test_a_failed_description_is_said_and_not_cached() -> None:
    describe = Describer(fail=True)
    step = ToolImages(describe)
    body = chat_body()
    run(step, body, vision=False, can_describe=True)
    assert FAILED in texts(body) and len(step.cache) == 0


def test_an_image_by_url_is_never_opened() -> None:
    describe = Describer()
    body = chat_body()
    body["messages"][2]["content"][1]["image_url"]["url"] = "http://169.254.169.254/latest/meta-data"
    run(ToolImages(describe), body, vision=False, can_describe=True)
    assert describe.asked == [] and NOT_INLINE in texts(body)


def test_a_long_image_set_aside_by_the_reader_is_described_from_its_bytes_and_moved_back_intact() -> None:
    big = "data:image/png;base64," + "A" * (200 * 1024)
    client = chat_body()
    client["messages"][2]["content"][1]["image_url"]["url"] = big
    raw = orjson.dumps(client)
    body, blobs, _ = parse_large(raw, 64)
    assert big not in texts(body)  # the reader left a placeholder in the parsed body
    describe = Describer()
    run(ToolImages(describe), dict(body), blobs, vision=False, can_describe=True)
    assert describe.asked[0][0] == big
    moved = dict(body)
    run(ToolImages(describe), moved, blobs, vision=True, can_describe=True)
    sent = orjson.loads(put_back(orjson.dumps(moved), blobs))
    assert sent["messages"][3]["content"][1]["image_url"]["url"] == big


def test_the_cache_is_bounded() -> None:
    cache = Descriptions(entries=2)
    for key in ("a", "b", "c"):
        cache.put(key, key)
    assert len(cache) == 2 and cache.get("a") is None and cache.get("c") == "c"


def test_set_aside_placeholders_round_trip() -> None:
    # The placeholder form the step resolves is the one the reader writes.
    raw = orjson.dumps({"u": "data:" + "B" * (70 * 1024)})
    cut, blobs = set_aside(raw)
    assert b"fleet-gateway-blob-0" in bytes(cut) and put_back(bytes(cut), blobs) == raw
