import base64
import os
from typing import Any

import orjson
import pytest

from gateway.pipeline.blobs import MIN_BLOB, put_back, set_aside
from gateway.pipeline.body import parse_large


def image_body(size: int, *, images: int = 1, escaped: bool = False) -> dict[str, Any]:
    data = base64.b64encode(os.urandom(size)).decode()
    url = "data:image/png;base64," + data
    if escaped:
        url = url[:100] + "/" + url[100:]  # orjson writes "/" as is; a "\\/" would need unescaping
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(images)]
    return {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what"}, *parts]}],
    }


@pytest.mark.parametrize("images", [1, 3])
def test_long_data_literals_are_set_aside_and_put_back_byte_for_byte(images: int) -> None:
    raw = orjson.dumps(image_body(200_000, images=images))
    skeleton, blobs = set_aside(raw)
    assert len(blobs.originals) == images and len(skeleton) < 2000
    body = orjson.loads(skeleton)
    body["max_tokens"] = 100  # a rewrite of the keys the gateway owns
    out = put_back(orjson.dumps(body), blobs)
    assert orjson.loads(out) == {**orjson.loads(raw), "max_tokens": 100}
    assert bytes(blobs.originals[0]) in out


def test_short_bodies_and_short_literals_are_parsed_as_usual() -> None:
    raw = orjson.dumps(image_body(1000))
    skeleton, blobs = set_aside(raw)
    assert skeleton is raw and not blobs
    many_short = [{"role": "user", "content": "data:" + "x" * 100} for _ in range(MIN_BLOB // 50)]
    big_but_short_literals = orjson.dumps({"messages": many_short})
    assert len(big_but_short_literals) > MIN_BLOB
    assert not set_aside(big_but_short_literals)[1]


def test_a_literal_with_escapes_is_parsed_not_set_aside() -> None:
    raw = orjson.dumps(image_body(200_000)).replace(b"base64,", b'base64,\\"', 1)
    assert not set_aside(raw)[1]


def test_parse_large_checks_what_read_object_checks() -> None:
    body, blobs, _ = parse_large(orjson.dumps(image_body(200_000)), 64)
    assert blobs and body["messages"][0]["content"][1]["type"] == "image_url"


def test_a_dropped_placeholder_is_skipped() -> None:
    raw = orjson.dumps(image_body(200_000, images=2))
    skeleton, blobs = set_aside(raw)
    body = orjson.loads(skeleton)
    body["messages"][0]["content"].pop(1)
    out = orjson.loads(put_back(orjson.dumps(body), blobs))
    assert len(out["messages"][0]["content"]) == 2
    assert out["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
