import asyncio
import gzip
import os
import zlib
from typing import Any

import orjson
import pytest

from gateway.errors import BadRequest, GatewayError, RequestTimeout, RequestTooLarge
from gateway.pipeline.body import (
    MAX_RATIO,
    ClientGone,
    decompress,
    long_digits,
    parse,
    read_body,
    read_object,
)
from gateway.pipeline.walk import KnownTools
from gateway.settings import Settings


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
        read_object(raw, max_depth=64)
    assert caught.value.status == 400 and caught.value.code == code
    assert "\ud800" not in caught.value.message


def test_depth_at_the_limit_is_fine() -> None:
    assert read_object(b'{"a":' + b"[" * 62 + b"]" * 62 + b"}", max_depth=64)[0]


def test_duplicate_keys_collapse_to_the_last() -> None:
    assert read_object(b'{"model":"a","model":"b"}', 64)[0] == {"model": "b"}


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


# --- Content-Encoding -----------------------------------------------------------------------------

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"hello " * 200 + b'"}]}'


@pytest.mark.parametrize(
    "pack",
    [
        lambda data: gzip.compress(data),
        lambda data: zlib.compress(data),  # "deflate" as RFC 1950 says (zlib framing)
        lambda data: zlib.compress(data)[2:-4],  # "deflate" as many clients send it (raw)
    ],
    ids=["gzip", "deflate-zlib", "deflate-raw"],
)
def test_compressed_bodies_are_inflated(pack: Any) -> None:
    encoding = "gzip" if pack(b"x")[:2] == b"\x1f\x8b" else "deflate"
    assert decompress(pack(BODY), encoding, limit=1 << 20) == BODY


def test_identity_and_no_encoding_pass_through() -> None:
    assert decompress(BODY, "identity", 10) is BODY
    assert decompress(BODY, "", 10) is BODY


def test_a_bomb_stops_at_the_ratio_cap_without_inflating_it_whole() -> None:
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in ~64 KiB
    with pytest.raises(RequestTooLarge) as caught:
        decompress(bomb, "gzip", limit=32 << 20)
    assert caught.value.status == 413 and f"{MAX_RATIO}x" in caught.value.message


def test_the_body_limit_holds_after_inflating() -> None:
    data = os.urandom(4096).hex().encode()  # barely compressible: the ratio is not what stops it
    with pytest.raises(RequestTooLarge):
        decompress(gzip.compress(data), "gzip", limit=4096)


@pytest.mark.parametrize(
    ("raw", "encoding", "status"),
    [(b"not gzip", "gzip", 400), (gzip.compress(BODY)[:-10], "gzip", 400), (BODY, "br", 415)],
    ids=["garbage", "truncated", "brotli"],
)
def test_bad_or_unknown_encodings_are_client_errors(raw: bytes, encoding: str, status: int) -> None:
    with pytest.raises(GatewayError) as caught:
        decompress(raw, encoding, limit=1 << 20)
    assert caught.value.status == status


@pytest.mark.parametrize(
    ("text", "found"),
    [
        (b'{"seed": 1234567890123456789}', True),  # 19 digits
        (b'{"seed": 123456789012345678}', False),  # 18
        (b'{"a": "12345678901234567890"}', True),  # in a string too: the slow path is only exact
        (b'{"a": 1.2345678901234567e5}', False),
    ],
)
def test_a_run_of_nineteen_digits_is_found(text: bytes, found: bool) -> None:
    assert long_digits(text) is found
    assert long_digits(bytearray(text)) is found


def test_a_long_run_across_the_slices_of_a_large_body_is_found() -> None:
    filler = b" " * ((1 << 20) - 10)
    assert long_digits(b'{"a":' + filler + b"12345678901234567890}")  # straddles the first slice's end
    assert not long_digits(b'{"a":' + filler + b"123456789 123456789}")


def test_an_integer_past_64_bits_is_forwarded_exactly() -> None:
    body = read_object(b'{"model": "m", "seed": 123456789012345678901234567890}', 64)[0]
    assert orjson.dumps(body) == b'{"model":"m","seed":123456789012345678901234567890}'


@pytest.mark.parametrize(
    "number",
    [
        b"-9223372036854775809",  # one below int64
        b"18446744073709551616",  # one above uint64
        b"123456789012345678901234567890",
    ],
)
def test_an_integer_past_64_bits_deep_inside_the_body_is_kept_exactly(number: bytes) -> None:
    raw = b'{"tools": [{"parameters": {"properties": {"n": {"default": ' + number + b"}}}}]}"
    body = read_object(raw, 64)[0]
    assert orjson.dumps(body) == raw.replace(b" ", b"")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "12345678901234567890", "b": [1, 2.5, -3]}',  # a long run, in a string only
        b'{"a": 1e19, "b": -2.5e30, "c": 1.5}',  # large floats, written as floats
        b'{"a": 18446744073709551615, "b": -9223372036854775808}',  # the 64-bit ends
    ],
)
def test_a_body_without_an_integer_past_64_bits_parses_as_orjson_reads_it(raw: bytes) -> None:
    assert read_object(raw, 64)[0] == orjson.loads(raw)
    assert orjson.dumps(read_object(raw, 64)[0]) == orjson.dumps(orjson.loads(raw))


def test_the_parse_hands_on_the_json_of_the_very_tool_list_it_walked() -> None:
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools})
    settings = Settings()
    known = KnownTools()
    for _ in range(2):  # the second time from what the walk remembered
        parsed = asyncio.run(parse(raw, settings, known))
        assert parsed.tools_json is not None and parsed.tools_json.of(parsed.body["tools"]) == orjson.dumps(
            tools
        )
    # Parsed again with exact integers (one past 64 bits), the body holds other objects: no JSON handed on.
    big = raw.replace(b'"model":"m"', b'"model":"m","seed":1e19,"n":18446744073709551616')
    parsed = asyncio.run(parse(big, settings, known))
    assert parsed.tools_json is None or parsed.tools_json.of(parsed.body["tools"]) is None
    # A large body is parsed on a worker thread, without the remembered lists.
    assert (
        asyncio.run(parse(raw, settings.model_copy(update={"offload_bytes": 10}), known)).tools_json is None
    )
