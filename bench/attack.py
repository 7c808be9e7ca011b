"""The attacks of issue 15, replayed against a gateway process: memory and descriptors, measured.

    python -m bench.attack [--repo PATH] [--out FILE]

Each attack runs against a fresh `python -m gateway serve` (from `--repo`, default this checkout,
so an older commit can be measured the same way) in front of bench.instant_upstream:

- heads: 3 connections each send a request line and 60 MiB of headers that never end; the
  gateway's RSS after they were sent (or refused);
- user: 200 requests, each with a unique 1 MiB `user` field; RSS once they are answered;
- sse: 3 streams whose replica sends one 150 MiB event with no blank line; peak RSS (VmHWM) and
  how each stream ended;
- slowloris: 300 connections trickle a header line a second for 25 s under a soft file limit of
  256; the gateway's open descriptors, and how many of 25 real requests (one a second) were answered.

Figures are the gateway's own process, read from /proc (MB = 10^6 bytes); nothing here is a
pass/fail bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
def fleet(repo: Path, endless: int = 0, nofile: int | None = None) -> Iterator[tuple[int, int]]:
    """An instant upstream and a gateway in front of it: yields (gateway port, gateway pid)."""
    processes = Processes()
    try:
        up = free_port()
        upstream = processes.start(
            "upstream", [sys.executable, "-m", "bench.instant_upstream", str(up), "--endless", str(endless)]
        )
        wait_ready(up, "/health", upstream, "upstream", 20)
        with tempfile.TemporaryDirectory() as tmp:
            routes = Path(tmp) / "routes.yaml"
            routes.write_text(ROUTES.format(port=up))
            port = free_port()

            def limit() -> None:
                if nofile is not None:
                    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

            gateway = processes.start(
                "gateway",
                [sys.executable, "-m", "gateway", "serve", "--routes", str(routes), "--port", str(port)],
                cwd=repo,
                env={"PATH": "/usr/bin:/bin", "GATEWAY_LOG_REQUESTS": "false", "PYTHONPATH": str(repo)},
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


def health(port: int) -> bool:
    try:
        with connect(port, 2) as sock:
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


ATTACKS = {"heads": heads, "user": user, "sse": sse, "slowloris": slowloris}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attack", description=__doc__)
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose gateway is attacked")
    parser.add_argument("--only", choices=sorted(ATTACKS), action="append", help="run only these")
    parser.add_argument("--out", type=Path, default=Path("bench-results.jsonl"))
    args = parser.parse_args()
    raise_nofile()
    record: dict[str, Any] = {**run_fields("attack", 1, False), "repo": str(args.repo)}
    for name in args.only or list(ATTACKS):
        record[name] = ATTACKS[name](args.repo)
        print(name, json.dumps(record[name]), flush=True)
    with args.out.open("a") as out:
        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
