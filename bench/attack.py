"""The attacks of issue 15 and of the security review, replayed against a gateway process: memory,
descriptors and what got through, measured.

    python -m bench.attack [--repo PATH] [--only NAME ...] [--out FILE]

Each attack runs against a fresh `python -m gateway serve` (from `--repo`, default this checkout,
so an older commit can be measured the same way) in front of bench.instant_upstream (or the
simulator, or a scripted answer, where the attack needs one):

- heads: 3 connections each send a request line and 60 MiB of headers that never end; the
  gateway's RSS after they were sent (or refused);
- user: 200 requests, each with a unique 1 MiB `user` field; RSS once they are answered;
- sse: 3 streams whose replica sends one 150 MiB event with no blank line; peak RSS (VmHWM) and
  how each stream ended;
- slowloris: 300 connections trickle a header line a second for 25 s under a soft file limit of
  256; the gateway's open descriptors, and how many of 25 real requests (one a second) were answered;
- descriptors: the same 300 unfinished heads under a hard file limit of 256 (nothing can lift it):
  whether a real request is answered (a 503 counts) or waits in the backlog;
- mcp_sessions: one key sends 10,000 `initialize` to /mcp; RSS (MiB) before and after, how many
  sessions the gateway kept for it (its first session still answering), and whether another key
  can then open one;
- mcp_trickle: 40 connections each trickle a 4 MB /mcp body at ~90 kB/s; after 45 s, how many got
  an answer (and which), when the first came, peak RSS (MiB);
- cross_site: on an open loopback gateway, what a web page in the user's browser can send without
  a preflight: chat and Messages POSTs with no Content-Type, and a bodyless
  `POST /admin/replicas/NAME/stop`, each with `Origin: https://evil.example`; the statuses;
- stored: key B asks for (GET) and deletes key A's stored Responses answer; the statuses;
- extract_schema: `extract` calls whose schema refers to a file (a FIFO, so an open shows) and to
  a listener of ours, and one whose `pattern` backtracks exponentially on the answer; whether the
  file was opened, how many connections the listener got, and /health's worst latency meanwhile;
- cut_charge: five streamed ~7,500-token prompts, each cut by its client after the first event,
  under `tokens_per_minute: 1000`; what the key was charged and whether its next request was admitted.

Figures are the gateway's own process, read from /proc (MB = 10^6 bytes, MiB = 2^20); nothing here
is a pass/fail bound.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from bench.proxycost.constants import ROOT
from bench.proxycost.host import MB, Processes, free_port, raise_nofile, rss_mb, run_fields, wait_ready

MIB = 1024 * 1024
ROUTES = """
presets:
  m:
    served_model: m
    replicas: [{{name: r0, url: "http://127.0.0.1:{port}", engine: vllm}}]
routing: {{default: m}}
"""


def peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    return float("nan")


def fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


@contextlib.contextmanager
def fleet(
    repo: Path,
    endless: int = 0,
    nofile: int | None = None,
    *,
    hard_nofile: bool = False,
    env: dict[str, str] | None = None,
    routes: str = ROUTES,
    upstream: list[str] | None = None,
) -> Iterator[tuple[int, int]]:
    """An upstream and a gateway in front of it: yields (gateway port, gateway pid). The upstream
    is bench.instant_upstream unless `upstream` gives another command (`{port}` is its port);
    `routes` is formatted with the same `port`."""
    processes = Processes()
    try:
        up = free_port()
        argv = [sys.executable, "-m", "bench.instant_upstream", str(up), "--endless", str(endless)]
        if upstream is not None:
            argv = [arg.format(port=up) for arg in upstream]
        process = processes.start("upstream", argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(up, "/health", process, "upstream", 20)
        with tempfile.TemporaryDirectory() as tmp:
            routes_file = Path(tmp) / "routes.yaml"
            routes_file.write_text(routes.format(port=up))
            port = free_port()

            def limit() -> None:
                if nofile is not None:
                    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile if hard_nofile else hard))

            gateway = processes.start(
                "gateway",
                [sys.executable, "-m", "gateway", "serve", "--routes", str(routes_file), "--port", str(port)],
                cwd=repo,
                env={
                    "PATH": "/usr/bin:/bin",
                    "GATEWAY_LOG_REQUESTS": "false",
                    "PYTHONPATH": str(repo),
                    "GATEWAY_STATE_DIR": tmp,
                    **(env or {}),
                },
                preexec_fn=limit,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_ready(port, "/health", gateway, "gateway", 30)
            yield port, gateway.pid
    finally:
        processes.close()


def connect(port: int, timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def post(port: int, body: bytes, timeout: float = 30) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    with connect(port, timeout) as sock:
        sock.sendall(head + body)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while piece := sock.recv(1 << 20):
                data += piece
        return data


def health(port: int, timeout: float = 2) -> bool:
    try:
        with connect(port, timeout) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def heads(repo: Path) -> dict[str, Any]:
    with fleet(repo) as (port, pid):
        before = rss_mb(pid)
        socks, sent = [], []
        line = b"x-pad: " + b"a" * (64 * 1024 - 9) + b"\r\n"
        for _ in range(3):
            sock = connect(port)
            socks.append(sock)
            total = 0
            with contextlib.suppress(OSError):
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
                while total < 60 * MIB:
                    sock.sendall(line)
                    total += len(line)
            sent.append(total)
        time.sleep(2)
        after = rss_mb(pid)
        for sock in socks:
            sock.close()
        return {"rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1), "bytes_accepted": sent}


def user(repo: Path) -> dict[str, Any]:
    with fleet(repo) as (port, pid):
        before = rss_mb(pid)
        ok = 0
        for i in range(200):
            name = (b"%06d" % i) * (MIB // 6)
            body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"user":"' + name + b'"}'
            ok += post(port, body).startswith(b"HTTP/1.1 200")
        time.sleep(1)
        return {"rss_before_mb": round(before, 1), "rss_after_mb": round(rss_mb(pid), 1), "answered_200": ok}


def sse(repo: Path) -> dict[str, Any]:
    with fleet(repo, endless=150) as (port, pid):
        before = rss_mb(pid)
        endings: list[str] = []
        body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'

        def one() -> None:
            data = post(port, body, timeout=60)
            tail = data[-400:]
            endings.append("error_event" if b'"error"' in tail else "done" if b"[DONE]" in tail else "other")

        threads = [threading.Thread(target=one) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        return {"rss_before_mb": round(before, 1), "peak_rss_mb": round(peak_mb(pid), 1), "endings": endings}


def slowloris(repo: Path) -> dict[str, Any]:
    with fleet(repo, nofile=256) as (port, pid):
        before = fds(pid)
        socks: list[socket.socket] = []
        for _ in range(300):
            with contextlib.suppress(OSError):
                sock = connect(port, 2)
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
                socks.append(sock)
        answered, peak = 0, fds(pid)
        for i in range(25):
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.sendall(b"x-trickle-%d: y\r\n" % i)
            answered += health(port)
            peak = max(peak, fds(pid))
            time.sleep(1)
        held = fds(pid)
        for sock in socks:
            sock.close()
        return {
            "fds_before": before,
            "fds_peak": peak,
            "fds_after_25s": held,
            "sockets_opened": len(socks),
            "real_requests_answered": f"{answered}/25",
        }


def descriptors(repo: Path) -> dict[str, Any]:
    with fleet(repo, nofile=256, hard_nofile=True, env={"GATEWAY_HEADER_TIMEOUT": "30"}) as (port, pid):
        socks: list[socket.socket] = []
        for _ in range(300):
            try:
                sock = connect(port, 2)
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
                socks.append(sock)
            except OSError:
                break
        status, waited = 0, None
        started = time.monotonic()
        try:
            with connect(port, 10) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
                head = sock.recv(64)
                status = int(head[9:12]) if head.startswith(b"HTTP/1.") else 0
                waited = round(time.monotonic() - started, 2)
        except OSError:
            pass
        held = fds(pid)
        for sock in socks:
            sock.close()
        return {
            "heads_opened": len(socks),
            "gateway_fds": held,
            "real_request_status": status or "no answer in 10 s",
            "answered_after_s": waited,
        }


# --- /mcp ---------------------------------------------------------------------------------------

MCP_VERSION = "2025-06-18"
INITIALIZE = orjson.dumps(
    {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": MCP_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "b", "version": "1"},
        },
    }
)
PING = orjson.dumps({"jsonrpc": "2.0", "id": 2, "method": "ping"})


def mcp_headers(key: str | None, session: str | None = None) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    if session is not None:
        headers |= {"mcp-session-id": session, "mcp-protocol-version": MCP_VERSION}
    return headers


def rss_mib(pid: int) -> float:
    return round(rss_mb(pid) * MB / MIB, 1)


def mcp_sessions(repo: Path, count: int = 10_000, threads: int = 4) -> dict[str, Any]:
    import httpx2

    with fleet(repo, env={"GATEWAY_API_KEYS": "attacker-key,victim-key"}) as (port, pid):
        url = f"http://127.0.0.1:{port}/mcp"
        before = rss_mib(pid)
        statuses: collections.Counter[int] = collections.Counter()
        first: list[str] = []
        lock = threading.Lock()

        def flood(n: int) -> None:
            with httpx2.Client(timeout=30) as client:
                for _ in range(n):
                    answer = client.post(url, content=INITIALIZE, headers=mcp_headers("attacker-key"))
                    with lock:
                        statuses[answer.status_code] += 1
                        if answer.status_code == 200 and not first:
                            first.append(answer.headers["mcp-session-id"])

        started = time.monotonic()
        workers = [threading.Thread(target=flood, args=(count // threads,)) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        seconds = round(time.monotonic() - started, 1)
        after = rss_mib(pid)
        victim = httpx2.post(url, content=INITIALIZE, headers=mcp_headers("victim-key"), timeout=30)
        oldest = httpx2.post(url, content=PING, headers=mcp_headers("attacker-key", first[0]), timeout=30)
        return {
            "initialize_statuses": dict(statuses),
            "seconds": seconds,
            "rss_before_mib": before,
            "rss_after_mib": after,
            "other_key_initialize": victim.status_code,
            "attackers_first_session": oldest.status_code,
        }


def mcp_trickle(repo: Path, connections: int = 40, seconds: float = 45.0) -> dict[str, Any]:
    size, piece, every = 4_000_000, 48 * 1024, 0.7  # ~70 kB/s each: the body is never whole in 45 s
    with fleet(repo) as (port, pid):
        before = rss_mib(pid)
        head = (
            b"POST /mcp HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"accept: application/json, text/event-stream\r\ncontent-length: %d\r\n\r\n" % size
        )
        socks = [connect(port) for _ in range(connections)]
        for sock in socks:
            sock.sendall(head + b'{"jsonrpc": "2.0", "id": 1, "pad": "')
        answers: dict[socket.socket, tuple[str, float]] = {}
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            waiting = [sock for sock in socks if sock not in answers]
            if not waiting:
                break
            readable, _, _ = select.select(waiting, [], [], 0)
            for sock in readable:
                with contextlib.suppress(OSError):
                    first = sock.recv(4096)
                    status = first[9:12].decode() if first.startswith(b"HTTP/1.") else "closed"
                    kind = "json" if b"application/json" in first.lower() else "plain"
                    answers[sock] = (
                        f"{status} {kind}" if status != "closed" else status,
                        time.monotonic() - started,
                    )
            for sock in waiting:
                if sock not in answers:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"x" * piece)
            time.sleep(every)
        held = rss_mib(pid)
        for sock in socks:
            sock.close()
        return {
            "rss_before_mib": before,
            "rss_at_end_mib": held,
            "peak_rss_mib": round(peak_mb(pid) * MB / MIB, 1),
            "answered": dict(collections.Counter(kind for kind, _ in answers.values())),
            "still_open_after_s": {str(int(seconds)): connections - len(answers)},
            "first_answer_s": round(min((t for _, t in answers.values()), default=float("nan")), 1),
        }


CROSS_SITE_ROUTES = """
presets:
  m:
    served_model: m
    replicas: [{{name: r0, url: "http://127.0.0.1:{port}", engine: vllm}}]
  l:
    served_model: l
    replicas: [{{name: l0, url: "http://127.0.0.1:9", engine: llamacpp, launch: {{cmd: ["/bin/true"]}}}}]
routing: {{default: m}}
"""


def cross_site(repo: Path) -> dict[str, Any]:
    """What a page's fetch() sends: no preflight for a POST without Content-Type, an Origin always."""
    evil = {"origin": "https://evil.example", "host": "127.0.0.1"}
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    messages = orjson.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    with fleet(repo, routes=CROSS_SITE_ROUTES) as (port, _):
        return {
            "chat_no_content_type": raw_status(port, "POST", "/v1/chat/completions", chat, evil),
            "messages_no_content_type": raw_status(port, "POST", "/v1/messages", messages, evil),
            "admin_stop_bodyless": raw_status(port, "POST", "/admin/replicas/l0/stop", b"", evil),
            "chat_no_content_type_no_origin": raw_status(port, "POST", "/v1/chat/completions", chat, {}),
        }


def raw_status(port: int, method: str, path: str, body: bytes, headers: dict[str, str]) -> int:
    lines = [f"{method} {path} HTTP/1.1", f"host: {headers.get('host', '127.0.0.1')}", "connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items() if k != "host"]
    lines.append(f"content-length: {len(body)}")
    with connect(port) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        head = sock.recv(64)
    return int(head[9:12]) if head.startswith(b"HTTP/1.") else 0


SIMULATOR = [
    sys.executable,
    "-m",
    "gateway.simulator",
    "--engine",
    "vllm",
    "--port",
    "{port}",
    "--model",
    "m",
]


def stored(repo: Path) -> dict[str, Any]:
    import httpx2

    env = {"GATEWAY_API_KEYS": "key-a,key-b"}
    with fleet(repo, env=env, upstream=[*SIMULATOR, "--time-scale", "0"]) as (port, _):
        base = f"http://127.0.0.1:{port}"

        def as_(key: str) -> dict[str, str]:
            return {"authorization": f"Bearer {key}"}

        made = httpx2.post(
            base + "/v1/responses",
            json={"model": "m", "input": "hi", "store": True},
            headers=as_("key-a"),
            timeout=30,
        )
        target = base + "/v1/responses/" + made.json()["id"]
        read = httpx2.get(target, headers=as_("key-b"), timeout=30)
        deleted = httpx2.delete(target, headers=as_("key-b"), timeout=30)
        own = httpx2.get(target, headers=as_("key-a"), timeout=30)
        return {
            "created_by_a": made.status_code,
            "b_reads_a": read.status_code,
            "b_deletes_a": deleted.status_code,
            "a_reads_own_after": own.status_code,
        }


# --- extract: a schema that reaches out, a pattern that backtracks ------------------------------

BACKTRACKING_ANSWER = '{"v": "' + "a" * 26 + '!"}'


def extract_schema(repo: Path) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        fleet(repo, upstream=[sys.executable, "-m", "bench.attack", "--answer", "{port}"]) as (port, _),
    ):
        fifo = Path(tmp) / "schema.json"
        os.mkfifo(fifo)
        listener = socket.create_server(("127.0.0.1", 0))
        listened = listener.getsockname()[1]
        found = {"file_opened": False, "listener_connections": 0}
        stop = threading.Event()
        threads = [
            threading.Thread(target=_watch_fifo, args=(fifo, found, stop), daemon=True),
            threading.Thread(target=_hold_connections, args=(listener, found, stop), daemon=True),
        ]
        latencies: list[float] = []
        threads.append(threading.Thread(target=_probe_health, args=(port, latencies, stop), daemon=True))
        for thread in threads:
            thread.start()
        schemas: dict[str, dict[str, Any]] = {
            "file_ref": {"type": "object", "properties": {"v": {"$ref": fifo.as_uri()}}},
            "url_ref": {"$ref": f"http://127.0.0.1:{listened}/schema.json"},
            "backtracking_pattern": {
                "type": "object",
                "properties": {"v": {"type": "string", "pattern": "^(a+)+$"}},
            },
        }
        outcomes = {name: _extract(port, schema) for name, schema in schemas.items()}
        stop.set()
        for thread in threads:
            thread.join(10)
        listener.close()
        return {
            **found,
            "calls": outcomes,
            "health_probes": len(latencies),
            "health_worst_ms": round(max(latencies, default=float("nan")) * 1000, 1),
            "health_over_100ms": sum(1 for latency in latencies if latency > 0.1),
        }


def _extract(port: int, schema: dict[str, Any], timeout: float = 60.0) -> str:
    """One `extract` call in its own MCP session: the tool's error text, `ok`, or how it failed."""
    import anyio
    import httpx2
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async def call() -> str:
        with anyio.fail_after(timeout):
            async with (
                httpx2.AsyncClient(timeout=timeout) as http,
                streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=http) as (read, write),
                ClientSession(read, write) as client,
            ):
                await client.initialize()
                result = await client.call_tool("extract", {"prompt": "the value", "json_schema": schema})
                text = "".join(getattr(part, "text", "") for part in result.content)
                return ("tool error: " + text[:120]) if result.is_error else "ok"

    try:
        return anyio.run(call)
    except TimeoutError:
        return f"no answer in {timeout:g} s"
    except Exception as exc:  # what the client saw, as a figure: the attack's outcome
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def _watch_fifo(fifo: Path, found: dict[str, Any], stop: threading.Event) -> None:
    """An open of the FIFO for reading shows as a writer that can open it; the reader gets `{}`."""
    while not stop.is_set():
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: nobody reads it
            time.sleep(0.01)
            continue
        found["file_opened"] = True
        with contextlib.suppress(OSError):
            os.write(fd, b"{}")
        os.close(fd)
        time.sleep(0.1)


def _hold_connections(listener: socket.socket, found: dict[str, Any], stop: threading.Event) -> None:
    """Counts connections, holds each 3 s without a byte (as a listener that stalls), then closes."""
    listener.settimeout(0.1)
    while not stop.is_set():
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        found["listener_connections"] += 1
        time.sleep(3)
        sock.close()


def _probe_health(port: int, latencies: list[float], stop: threading.Event) -> None:
    while not stop.is_set():
        started = time.monotonic()
        ok = health(port, timeout=30)
        if ok:
            latencies.append(time.monotonic() - started)
        time.sleep(0.02)


CUT_KEY = "cut-key"
CUT_DIGEST = hashlib.sha256(CUT_KEY.encode()).hexdigest()
# `fleet` formats the routes with the upstream's port: braces doubled, the digest put in first.
CUT_ROUTES = (
    ROUTES
    + 'keys:\n  - {{name: cutter, key_sha256: "'
    + CUT_DIGEST
    + '", limits: {{tokens_per_minute: 1000}}}}\n'
)


def cut_charge(repo: Path) -> dict[str, Any]:
    """Five streamed prompts of ~7,500 tokens, each closed by the client after its first event (the
    replica holds the rest), under tokens_per_minute 1000: what the key was charged, and whether its
    next request was admitted."""
    hold = [sys.executable, "-m", "bench.instant_upstream", "{port}", "--hold"]
    with fleet(repo, routes=CUT_ROUTES, upstream=hold) as (port, _):
        prompt = "lorem ipsum dolor sit amet " * 1100
        body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": prompt}]})
        statuses = []
        for _ in range(5):
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            )
            head += b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n" % (CUT_KEY.encode(), len(body))
            with connect(port, 10) as sock:
                sock.sendall(head + body)
                first = sock.recv(65536)  # the status line and the first event; then the client leaves
                statuses.append(int(first.split(b" ", 2)[1]) if first.startswith(b"HTTP/1.1") else 0)
            time.sleep(0.3)  # the gateway notices the client left and charges what it relayed
        small = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        head += b"authorization: Bearer %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (
            CUT_KEY.encode(),
            len(small),
        )
        with connect(port, 10) as sock:
            sock.sendall(head + small)
            answer = sock.recv(65536)
        usage_head = (
            b"GET /v1/usage HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer %s\r\n" % CUT_KEY.encode()
        )
        with connect(port, 10) as sock:
            sock.sendall(usage_head + b"connection: close\r\n\r\n")
            usage_raw = b""
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                while piece := sock.recv(65536):
                    usage_raw += piece
        charged: Any = None
        with contextlib.suppress(Exception):
            charged = orjson.loads(usage_raw.split(b"\r\n\r\n", 1)[1])["presets"].get("m")
        return {
            "cut_streams": statuses,
            "charged": charged,
            "next_request_status": int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1") else 0,
        }


def big_answer(repo: Path) -> dict[str, Any]:
    """Non-streaming answers of about 60 MiB (an embeddings batch): the gateway's peak RSS over its
    idle RSS for one answer, and for four at once (each in a fresh gateway)."""
    whole = [sys.executable, "-m", "bench.instant_upstream", "{port}", "--whole", "60"]
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    out: dict[str, Any] = {}
    for clients in (1, 4):
        env = {"GATEWAY_MAX_ANSWER_BYTES": str(100 * MIB)}
        with fleet(repo, upstream=whole, env=env) as (port, pid):
            before = rss_mb(pid)
            sizes: list[int] = []

            def one(into: list[int] = sizes, at: int = port) -> None:
                into.append(len(post(at, body, 60)))

            threads = [threading.Thread(target=one) for _ in range(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            out[f"{clients}_answers"] = {
                "rss_before_mb": round(before, 1),
                "peak_over_idle_mb": round(peak_mb(pid) - before, 1),
                "answer_mb": round(max(sizes, default=0) / MB, 1),
            }
    return out


def answer_server(port: int) -> None:
    """`--answer PORT`: a replica whose every chat answer is BACKTRACKING_ANSWER (streamed or not)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    content = BACKTRACKING_ANSWER

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            models = {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 32768}]}
            self._send(
                orjson.dumps(models) if self.path.startswith("/v1/models") else b"{}", "application/json"
            )

        def do_POST(self) -> None:
            request = orjson.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
            usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
            if request.get("stream"):
                delta = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": content}}],
                }
                end = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                    "usage": usage,
                }
                body = (
                    b"data: "
                    + orjson.dumps(delta)
                    + b"\n\ndata: "
                    + orjson.dumps(end)
                    + b"\n\ndata: [DONE]\n\n"
                )
                self._send(body, "text/event-stream")
                return
            message = {"role": "assistant", "content": content}
            whole = {
                "id": "c",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": usage,
            }
            self._send(orjson.dumps(whole), "application/json")

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


ATTACKS = {
    "heads": heads,
    "user": user,
    "sse": sse,
    "slowloris": slowloris,
    "descriptors": descriptors,
    "mcp_sessions": mcp_sessions,
    "mcp_trickle": mcp_trickle,
    "cross_site": cross_site,
    "stored": stored,
    "extract_schema": extract_schema,
    "cut_charge": cut_charge,
    "big_answer": big_answer,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attack", description=__doc__)
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose gateway is attacked")
    parser.add_argument("--only", choices=sorted(ATTACKS), action="append", help="run only these")
    parser.add_argument("--out", type=Path, default=Path("bench-results.jsonl"))
    parser.add_argument("--answer", type=int, metavar="PORT", help=argparse.SUPPRESS)  # extract's replica
    args = parser.parse_args()
    if args.answer:
        answer_server(args.answer)
        return
    raise_nofile()
    record: dict[str, Any] = {**run_fields("attack", 1, False), "repo": str(args.repo)}
    for name in args.only or list(ATTACKS):
        record[name] = ATTACKS[name](args.repo)
        print(name, json.dumps(record[name]), flush=True)
    with args.out.open("a") as out:
        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
