from typing import Any

import pytest

from gateway.errors import BadRequest, RequestTimeout, RequestTooLarge
from gateway.pipeline.body import ClientGone, has_images, parse_object, read_body


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", "invalid_json"),
        (b"{", "invalid_json"),
        (b"[1]", "invalid_json"),
        (b'"text"', "invalid_json"),
        (b'{"a": NaN}', "invalid_json"),
        (b'{"a": Infinity}', "invalid_json"),
        (b'{"a": 1e999}', "invalid_json"),
        (b'{"a": "\\ud800"}', "invalid_json"),
        (b'{"a": "\xff"}', "invalid_json"),
        (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json"),
        (b'{"a":' + b"[" * 70 + b"]" * 70 + b"}", "json_too_deep"),
    ],
)
def test_bad_bodies_are_400_never_500(raw: bytes, code: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_object(raw, max_depth=64)
    assert caught.value.status == 400 and caught.value.code == code
    assert "\ud800" not in caught.value.message


def test_depth_at_the_limit_is_fine() -> None:
    assert parse_object(b'{"a":' + b"[" * 62 + b"]" * 62 + b"}", max_depth=64)


def test_duplicate_keys_collapse_to_the_last() -> None:
    assert parse_object(b'{"model":"a","model":"b"}', 64) == {"model": "b"}


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([{"role": "user", "content": "look at image_url please"}], False),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], False),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}}]}], True),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], True),
        (["not a dict", {"role": "user", "content": None}], False),
    ],
)
def test_images_are_found_structurally(messages: list[Any], expected: bool) -> None:
    assert has_images({"messages": messages}) is expected


def feeder(*messages: dict[str, Any]) -> Any:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


@pytest.mark.anyio
async def test_read_body_joins_chunks() -> None:
    receive = feeder(
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
    )
    assert await read_body(receive, None, 10, 1) == b"abcd"


@pytest.mark.anyio
async def test_content_length_over_the_limit_is_refused_unread() -> None:
    async def receive() -> dict[str, Any]:
        raise AssertionError("must not read")

    with pytest.raises(RequestTooLarge):
        await read_body(receive, 11, 10, 1)


@pytest.mark.anyio
async def test_chunked_body_over_the_limit_stops_reading() -> None:
    receive = feeder(*({"type": "http.request", "body": b"x" * 4, "more_body": True} for _ in range(5)))
    with pytest.raises(RequestTooLarge) as caught:
        await read_body(receive, None, 10, 1)
    assert caught.value.status == 413


@pytest.mark.anyio
async def test_a_body_that_never_ends_times_out() -> None:
    import asyncio

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(10)
        raise AssertionError

    with pytest.raises(RequestTimeout):
        await read_body(receive, None, 10, 0.05)


@pytest.mark.anyio
async def test_a_client_that_leaves_while_sending() -> None:
    with pytest.raises(ClientGone):
        await read_body(feeder({"type": "http.disconnect"}), None, 10, 1)
