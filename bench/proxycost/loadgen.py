"""The Python load clients, for what wrk cannot do (time to first token, held streams, varied
requests, big bodies, the /health probe). They run as child processes pinned to core 1, through
`python -m bench.gateway --child KIND PARAMS` (from the repository root); the run talks to them
with `call_child` and `read_line`."""

from __future__ import annotations

import asyncio
import json
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.proxycost.bodies import SYSTEM_PROMPT, chat_body, conversation_16k, image_body
from bench.proxycost.constants import MAX_BODY, ROOT
from bench.proxycost.host import BenchError, pin, raise_nofile

PROBE_INTERVAL = 0.010


def _head(method: str, path: str, length: int, headers: dict[str, str] | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    return f"{head}{extra}content-length: {length}\r\n\r\n".encode()


def _request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """`headers`: a contender's own (the team's key), from the `headers` of a child's params."""
    return _head(method, path, len(body), headers) + body


@dataclass
class Answer:
    status: int
    body: bytes
    first_event: float | None = None  # perf_counter when the first `data: ` chunk arrived


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    length = re.search(rb"\r\ncontent-length:\s*(\d+)", lower)
    if length:
        body = await reader.readexactly(int(length.group(1)))
        return Answer(status, body, time.perf_counter() if b"data: " in body else None)
    if b"transfer-encoding: chunked" not in lower:
        return Answer(status, await reader.read())
    parts: list[bytes] = []
    first: float | None = None
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            break
        chunk = (await reader.readexactly(size + 2))[:-2]
        if first is None and b"data: " in chunk:
            first = time.perf_counter()
        parts.append(chunk)
    return Answer(status, b"".join(parts), first)


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, limit=2**20), timeout=10
    )
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def child_ttft(params: dict[str, Any]) -> dict[str, Any]:
    """Streaming requests one at a time on one keep-alive connection: request sent -> first body
    byte of an SSE data event, and the number of content chunks each stream carried."""
    reader, writer = await _connect(params["port"])
    request = _request("POST", params["path"], params["body"].encode(), params.get("headers"))
    samples: list[float] = []
    chunks: set[int] = set()
    for i in range(params["warmup"] + params["count"]):
        start = time.perf_counter()
        writer.write(request)
        answer = await asyncio.wait_for(read_answer(reader), timeout=10)
        if answer.status != 200 or answer.first_event is None:
            raise BenchError(f"stream answered {answer.status}: {answer.body[:200]!r}")
        chunks.add(answer.body.count(b'"content":"tok"'))
        if i >= params["warmup"]:
            samples.append((answer.first_event - start) * 1000)
    writer.close()
    return {"ttft_ms": samples, "chunks": sorted(chunks)}


async def child_hold(params: dict[str, Any]) -> dict[str, Any]:
    """Open `count` streams, each read up to its first event, and keep them open until told."""
    raise_nofile()
    opened: list[asyncio.StreamWriter] = []
    failed: list[str] = []
    gate = asyncio.Semaphore(64)
    request = _request("POST", params["path"], params["body"].encode(), params.get("headers"))

    async def open_one() -> None:
        async with gate:
            try:
                reader, writer = await _connect(params["port"])
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
                if not head.startswith(b"HTTP/1.1 200"):
                    failed.append(head.split(b"\r\n", 1)[0].decode())
                    writer.close()
                    return
                data = b""
                while b"data: " not in data:
                    more = await asyncio.wait_for(reader.read(4096), timeout=30)
                    if not more:
                        raise ConnectionError("closed before the first event")
                    data += more
                opened.append(writer)
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                failed.append(repr(exc))

    started = time.perf_counter()
    await asyncio.gather(*(open_one() for _ in range(params["count"])))
    seconds = time.perf_counter() - started
    print(json.dumps({"opened": len(opened), "failed": failed[:5], "failures": len(failed)}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for writer in opened:
        writer.close()
    await asyncio.sleep(0.2)
    return {"opened": len(opened), "failures": len(failed), "open_seconds": seconds}


async def child_load(params: dict[str, Any]) -> dict[str, Any]:
    """`count` varied requests over `connections` keep-alive connections, for the growth test:
    1,000 distinct system prompts, 100 users, every fourth request a stream, so caches keyed by
    content reach their bounds. (wrk's thread:stop() does not end a run before its duration.)"""
    count, port, path, headers = params["count"], params["port"], params["path"], params.get("headers")
    errors = 0
    next_number = 0

    def body(n: int) -> bytes:
        messages = [
            {"role": "system", "content": f"Agent {n % 1000}. {SYSTEM_PROMPT}"},
            {"role": "user", "content": f"Question {n}: what does this function return?"},
        ]
        payload: dict[str, Any] = {"model": "bench", "user": f"u{n % 100}", "messages": messages}
        if n % 4 == 0:
            payload["stream"] = True
        return _request("POST", path, json.dumps(payload, separators=(",", ":")).encode(), headers)

    async def worker() -> None:
        nonlocal errors, next_number
        reader, writer = await _connect(port)
        while next_number < count:
            next_number += 1
            writer.write(body(next_number))
            answer = await asyncio.wait_for(read_answer(reader), timeout=30)
            errors += answer.status != 200
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(params["connections"])))
    return {"requests": next_number, "errors": errors, "seconds": time.perf_counter() - started}


async def child_bodies(params: dict[str, Any]) -> dict[str, Any]:
    """Large request bodies, timed from the first byte sent to the last byte of the answer:
    the 16k-token conversation (sequential), a 32 MiB image request (sequential), 4 concurrent
    8 MiB ones. Windows (CLOCK_MONOTONIC) of the big ones let the probe's samples be matched."""
    port, path, headers = params["port"], params["path"], params.get("headers")
    small = chat_body("bench", stream=False, messages=conversation_16k())
    big = image_body(MAX_BODY - 1024)
    eight = image_body(8 * 1024 * 1024)
    windows: dict[str, list[tuple[float, float]]] = {"32m": [], "4x8m": []}

    async def send(body: bytes, connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> float:
        reader, writer = connection
        start = time.perf_counter()
        writer.write(_head("POST", path, len(body), headers))
        writer.write(body)
        await writer.drain()
        answer = await asyncio.wait_for(read_answer(reader), timeout=120)
        if answer.status != 200:
            raise BenchError(f"a {len(body)}-byte body answered {answer.status}: {answer.body[:300]!r}")
        return (time.perf_counter() - start) * 1000

    connections = [await _connect(port) for _ in range(4)]
    for _ in range(3):
        await send(small, connections[0])
    body_16k = [await send(small, connections[0]) for _ in range(params["small"])]
    body_32m = []
    for _ in range(params["big"]):
        began = time.monotonic()
        body_32m.append(await send(big, connections[0]))
        windows["32m"].append((began, time.monotonic()))
    body_4x8m = []
    for _ in range(params["big"]):
        began = time.monotonic()
        start = time.perf_counter()
        await asyncio.gather(*(send(eight, connection) for connection in connections))
        body_4x8m.append((time.perf_counter() - start) * 1000)
        windows["4x8m"].append((began, time.monotonic()))
    for _, writer in connections:
        writer.close()
    return {
        "body_16k_ms": body_16k,
        "body_32m_ms": body_32m,
        "body_4x8m_ms": body_4x8m,
        "bytes_16k": len(small),
        "windows": windows,
    }


def child_probe(params: dict[str, Any]) -> dict[str, Any]:
    """GET /health every 10 ms on one keep-alive connection until SIGTERM. Blocking socket and
    time.sleep: a timer resolution far below the 1 ms of an event loop's. Latency is counted from
    each probe's scheduled time (as wrk2 does), so a stall counts for every probe it delayed."""
    stop = False

    def finish(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, finish)
    sock = socket.create_connection(("127.0.0.1", params["port"]), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    samples: list[tuple[float, float]] = []
    print(json.dumps({"ready": True}), flush=True)
    begin = time.monotonic()
    deadline = begin + params["limit_s"]
    i = 0
    while not stop and time.monotonic() < deadline:
        scheduled = begin + i * PROBE_INTERVAL
        i += 1
        delay = scheduled - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sock.sendall(request)
        data = b""
        while True:
            more = sock.recv(4096)
            if not more:
                raise ConnectionError("the gateway closed the probe's connection")
            data += more
            end = data.find(b"\r\n\r\n")
            if end >= 0:
                length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", data[:end])
                if length and len(data) >= end + 4 + int(length.group(1)):
                    break
        samples.append((scheduled, (time.monotonic() - scheduled) * 1000))
    sock.close()
    return {"samples": samples}


CHILDREN: dict[str, Callable[[dict[str, Any]], Any]] = {
    "ttft": child_ttft,
    "hold": child_hold,
    "load": child_load,
    "bodies": child_bodies,
    "probe": child_probe,
}


def run_child(kind: str, params: dict[str, Any]) -> None:
    function = CHILDREN[kind]
    if asyncio.iscoroutinefunction(function):
        import uvloop

        result = uvloop.run(function(params))
    else:
        result = function(params)
    print(json.dumps(result), flush=True)


def child_argv(kind: str, params: dict[str, Any]) -> list[str]:
    """Through the entry point, as a module: run it with `cwd=ROOT` (`Processes.start` does)."""
    return [*pin(1), sys.executable, "-m", "bench.gateway", "--child", kind, json.dumps(params)]


def call_child(kind: str, params: dict[str, Any], timeout: float, against: str) -> dict[str, Any]:
    out = subprocess.run(
        child_argv(kind, params), capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
    )
    if out.returncode != 0:
        raise BenchError(f"the {kind} client failed against {against}:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def read_line(process: subprocess.Popen[bytes], timeout: float, what: str) -> dict[str, Any]:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise BenchError(f"{what}: no answer within {timeout:g} s")
    line = process.stdout.readline()
    if not line:
        raise BenchError(f"{what}: the client exited ({process.wait(5)})")
    result: dict[str, Any] = json.loads(line)
    return result
