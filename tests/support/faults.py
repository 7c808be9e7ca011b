"""FU, the scripted fake upstream of the reliability and security tests (docs/failures.md).

A raw-socket HTTP/1.1 server on asyncio protocols, with no framework in the way, so that it can
misbehave exactly: close or reset before headers, hang, stall mid-stream, cut an event in half,
answer in 1-byte TCP segments, send a 100 MB error body, or close idle keep-alive connections at a
chosen second. Every connection is recorded (request line, headers, body, t_accept, and t_eof: when
the gateway's FIN or RST arrived), because most gates of the catalogue are measured on the upstream
side: "the FU sees EOF within 1.2 s", "B receives exactly one request".

Two ways to run it:
- in a thread of the test process (`FaultServer`), when the test wants the records and shares the
  monotonic clock with its own measurements;
- as a subprocess (`FaultProcess`, `python -m tests.support.faults --port P --script stream`), when
  a test needs real SIGKILL semantics: the kernel, not Python, closes the sockets.

The script's behaviours are in fault_behaviours.py, what FU records in fault_records.py, and each
connection's protocol in fault_connection.py (all in tests/support/). None of them imports the
gateway, so the subprocess starts fast and cannot be broken by the code under test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from tests.support.fault_behaviours import Behaviour, CloseBeforeHeaders, Hang, Reply, ResetBeforeHeaders, Sse
from tests.support.fault_connection import Conn
from tests.support.fault_records import Connection, Request, now
from tests.support.rawhttp import LOOPBACK, http_request

REPO = Path(__file__).resolve().parents[2]
CHAT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
PROBE_PATHS = frozenset({"/health", "/v1/models", "/metrics", "/_fu/stats"})
VLLM_METRICS = (
    b'vllm:num_requests_running{model_name="m"} 0.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'
)

# alternate: ok, fail, ok, ...; pairs: ok, ok, fail, fail, ... (two failures in a row, never three)
HealthMode = Literal["ok", "fail", "alternate", "pairs", "timeout"]
Route = Callable[[Request], Behaviour]


class FaultServer:
    """The FU in a background thread with its own event loop, on 127.0.0.1.

    POSTs to the chat paths are answered from `script` (a queue, consumed in order), then from
    `route(request)` or `default`. `/health`, `/v1/models`, `/metrics` and `/_fu/stats` are answered
    by the FU itself, outside the script; anything else gets llama-server's 404.
    """

    def __init__(
        self,
        script: Sequence[Behaviour] = (),
        *,
        default: Behaviour | None = None,
        route: Route | None = None,
        name: str = "fu",
        port: int = 0,
        health: HealthMode = "ok",
        idle_close: float | None = None,
        sndbuf: int | None = None,
        model: str = "m",
        context: int = 32768,
    ) -> None:
        self.name = name
        self.script: deque[Behaviour] = deque(script)
        self.default = default or Reply()
        self.route = route
        self.health: HealthMode = health
        self.idle_close = idle_close
        self.sndbuf = sndbuf
        self.model = model
        self.context = context
        self.connections: list[Connection] = []
        self.requests: list[Request] = []
        self.probes: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self.active = 0
        self.max_active = 0
        self._port = port
        self._ids = itertools.count(1)
        self._conns: set[Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None

    # lifecycle

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._port}"

    def start(self) -> FaultServer:
        self._thread = threading.Thread(target=self._run, name=f"fu-{self.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"FU {self.name} did not start")
        if self._failure is not None:
            raise RuntimeError(f"FU {self.name} failed to start") from self._failure
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kill(self) -> None:
        """The replica dies: the listener closes and every connection is reset, as after SIGKILL."""
        self._call(self._kill)

    def push(self, *behaviours: Behaviour) -> None:
        self.script.extend(behaviours)

    # what tests read

    @property
    def chat_requests(self) -> list[Request]:
        return [r for r in self.requests if r.method == "POST" and r.path in CHAT_PATHS]

    @property
    def other_requests(self) -> list[Request]:
        """Requests to paths that are neither the chat paths nor the probes: none should ever come."""
        return [r for r in self.requests if r.path not in CHAT_PATHS and r.path not in PROBE_PATHS]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Block until predicate() holds (re-checked whenever a record changes) or timeout passes."""
        deadline = now() + timeout
        with self._cond:
            while not predicate():
                left = deadline - now()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    # internals

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _call(self, fn: Callable[[], Any]) -> None:
        assert self._loop is not None
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(5)

    def _kill(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.reset()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # reported to start(); a thread must not raise into pytest
            self._failure = exc
            self._ready.set()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Conn(self), LOOPBACK, self._port, backlog=2048, reuse_address=True
        )
        self._port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        self._server.close()
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        await asyncio.sleep(0)  # let the aborted transports run connection_lost

    async def _respond(self, conn: Conn, req: Request) -> bool:
        if req.path == "/health":
            return await self._health(conn, req)
        if req.path == "/v1/models":
            models = {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "owned_by": "vllm", "max_model_len": self.context}
                ],
            }
            return await Reply(body=models).run(conn, req)
        if req.path == "/metrics":
            return await Reply(body=VLLM_METRICS, headers=(("content-type", "text/plain"),)).run(conn, req)
        if req.path == "/_fu/stats":
            return await Reply(body=self.stats()).run(conn, req)
        if req.method != "POST" or req.path not in CHAT_PATHS:
            missing = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
            return await Reply(404, missing).run(conn, req)
        behaviour = self.script.popleft() if self.script else None
        if behaviour is None:
            behaviour = self.route(req) if self.route is not None else self.default
        req.behaviour = type(behaviour).__name__
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self._changed()
        try:
            return await behaviour.run(conn, req)
        finally:
            self.active -= 1
            req.t_done = now()
            self._changed()

    async def _health(self, conn: Conn, req: Request) -> bool:
        mode = self.health
        if mode == "alternate":
            mode = "ok" if len(self.probes) % 2 == 0 else "fail"
        elif mode == "pairs":
            mode = "ok" if len(self.probes) % 4 < 2 else "fail"
        self.probes.append((now(), mode))
        self._changed()
        if mode == "timeout":
            await conn.wait_lost()
            return False
        if mode == "fail":
            loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
            return await Reply(503, loading).run(conn, req)
        return await Reply(200, {"status": "ok"}).run(conn, req)

    def stats(self) -> dict[str, Any]:
        chats = self.chat_requests
        return {
            "name": self.name,
            "chat_requests": len(chats),
            "chat_times": [r.t_received for r in chats],
            "connections": len(self.connections),
            "active": self.active,
            "max_active": self.max_active,
        }


@contextlib.contextmanager
def fault_server(*script: Behaviour, **options: Any) -> Iterator[FaultServer]:
    server = FaultServer(script, **options).start()
    try:
        yield server
    finally:
        server.stop()


# --- subprocess mode ------------------------------------------------------------------------------------

SCRIPTS = ("json", "stream", "hang", "503", "close", "reset")


def scripted(name: str, events: int, delay: float) -> Behaviour:
    if name == "json":
        return Reply(delay=delay)
    if name == "stream":
        return Sse(events=events, delay=delay)
    if name == "hang":
        return Hang()
    if name == "503":
        return Reply(503, {"error": {"message": "busy", "type": "Service Unavailable", "code": 503}})
    if name == "close":
        return CloseBeforeHeaders()
    if name == "reset":
        return ResetBeforeHeaders()
    raise ValueError(f"unknown script {name!r}; choose from {', '.join(SCRIPTS)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.faults", description="The scripted fake upstream."
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--script", choices=SCRIPTS, default="stream")
    parser.add_argument("--events", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--name", default="fu")
    parser.add_argument("--health", choices=("ok", "fail", "alternate", "pairs", "timeout"), default="ok")
    parser.add_argument("--idle-close", type=float, default=None)
    args = parser.parse_args(argv)
    server = FaultServer(
        default=scripted(args.script, args.events, args.delay),
        name=args.name,
        port=args.port,
        health=args.health,
        idle_close=args.idle_close,
    ).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"FU READY {server.port}", flush=True)
    stop.wait()
    server.stop()
    return 0


class FaultProcess:
    """The FU as a child process: `kill()` is a real SIGKILL, `start()` again restarts it on its port."""

    def __init__(self, port: int, *args: str) -> None:
        self.port = port
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 15.0) -> FaultProcess:
        command = [sys.executable, "-m", "tests.support.faults", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
        )
        assert self.proc.stdout is not None
        line = read_line(self.proc.stdout, timeout)
        if not line.startswith(b"FU READY"):
            self.kill()
            raise RuntimeError(f"FU subprocess on port {self.port} did not start: {line!r}")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def stats(self) -> dict[str, Any]:
        response = http_request(("127.0.0.1", self.port), "GET", "/_fu/stats", timeout=5)
        result: dict[str, Any] = json.loads(response.body)
        return result


def read_line(stream: Any, timeout: float) -> bytes:
    """One line from a child's pipe, waiting at most `timeout` seconds."""
    deadline = now() + timeout
    data = b""
    fd = stream.fileno()
    while not data.endswith(b"\n"):
        left = deadline - now()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        piece = os.read(fd, 1)
        if not piece:
            break
        data += piece
    return data


if __name__ == "__main__":
    raise SystemExit(main())
