"""An upstream that costs almost nothing: fixed answers from a raw asyncio protocol on uvloop.

Benchmarks measure the gateway, not the replica: this answers `POST` with a fixed chat completion
(or, for `"stream": true`, N SSE chunks) and `GET /health` with 200, with keep-alive, in a few
microseconds of CPU. Run it on its own core: `taskset -c 1 python -m bench.instant_upstream PORT`
(from the repository root).

    python -m bench.instant_upstream PORT [CHUNKS] [--hold]

`--hold` (for memory tests with many open streams): a streaming answer sends its headers and one
chunk, then nothing more; the connection stays open until the client closes it.

`--endless MIB` (for bench.attack): a streaming answer sends one event, then one event of MIB MiB
that never gets its blank line, then ends.

`--whole MIB` (for bench.attack): a non-streaming answer is an embeddings-shaped JSON body of about MIB
MiB, its usage at the end.
"""

from __future__ import annotations

import argparse
import asyncio

import orjson

COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
)
MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 32768}]})


def _response(body: bytes, content_type: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (content_type, len(body))
    return head + body


DELTA = b'{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}'
EVENT = b"data: " + DELTA + b"\n\n"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
# --hold: the headers and one event, then silence until the client leaves.
HELD_STREAM = STREAM_HEAD + b"%x\r\n%s\r\n" % (len(EVENT), EVENT)


def stream_response(chunks: int) -> bytes:
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":%d}}\n\n' % chunks
    parts = [STREAM_HEAD]
    # One HTTP chunk per event, as a real replica sends them.
    for piece in [EVENT] * chunks + [usage, b"data: [DONE]\n\n"]:
        parts.append(b"%x\r\n%s\r\n" % (len(piece), piece))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


def whole_response(mib: int) -> bytes:
    row = b'{"object":"embedding","index":0,"embedding":[' + b"0.0123456789," * 1023 + b"0.0123456789]}"
    rows = b",".join([row] * max(1, (mib << 20) // len(row)))
    usage = b'"usage":{"prompt_tokens":5,"total_tokens":5}'
    return _response(b'{"object":"list","data":[' + rows + b"]," + usage + b"}")


def endless_response(mib: int) -> bytes:
    piece = b"z" * (1 << 20)
    parts = [STREAM_HEAD, b"%x\r\n%s\r\n" % (len(EVENT), EVENT), b"6\r\ndata: \r\n"]
    parts += [b"%x\r\n%s\r\n" % (len(piece), piece)] * mib
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


class InstantUpstream(asyncio.Protocol):
    chunks = 64
    hold = False
    endless = 0
    whole = 0

    def __init__(self) -> None:
        # A bytearray: appending the pieces of a 32 MiB body stays linear (bytes += is quadratic).
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.held = False
        self.answers = {
            False: _response(COMPLETION),
            True: HELD_STREAM if self.hold else stream_response(self.chunks),
        }
        if self.endless:
            self.answers[True] = endless_response(self.endless)
        if self.whole:
            self.answers[False] = WHOLE.setdefault(self.whole, whole_response(self.whole))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.held:
            return  # a held stream never answers anything else
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                length = int(head[at + 15 :].split(b"\r\n", 1)[0])
            if len(self.buffer) < end + 4 + length:
                return
            stream = self.buffer.find(b'"stream":true', end + 4, end + 4 + length) >= 0
            del self.buffer[: end + 4 + length]
            assert self.transport is not None
            if head.startswith(b"get /health"):
                self.transport.write(_response(b""))
            elif head.startswith(b"get /v1/models"):
                self.transport.write(_response(MODELS))
            else:
                self.transport.write(self.answers[stream])
                if stream and self.hold:
                    self.held = True
                    return


WHOLE: dict[int, bytes] = {}  # built once per size: every connection answers the same bytes


async def serve(port: int, chunks: int = 64, hold: bool = False, endless: int = 0, whole: int = 0) -> None:
    InstantUpstream.chunks = chunks
    InstantUpstream.hold = hold
    InstantUpstream.endless = endless
    InstantUpstream.whole = whole
    server = await asyncio.get_running_loop().create_server(InstantUpstream, "127.0.0.1", port, backlog=4096)
    await server.serve_forever()


if __name__ == "__main__":
    import uvloop

    parser = argparse.ArgumentParser(
        prog="python -m bench.instant_upstream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("port", type=int)
    parser.add_argument("chunks", type=int, nargs="?", default=64, help="SSE chunks per stream (default 64)")
    parser.add_argument(
        "--hold", action="store_true", help="streams send one chunk, then hold the connection"
    )
    parser.add_argument(
        "--endless", type=int, default=0, metavar="MIB", help="streams end in one endless event"
    )
    parser.add_argument("--whole", type=int, default=0, metavar="MIB", help="whole answers of about MIB MiB")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.chunks, args.hold, args.endless, args.whole))
