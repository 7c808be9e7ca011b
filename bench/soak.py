"""A bounded soak: does the gateway hold its memory and its latency over minutes of streaming?

    python -m bench.soak                      # 10 minutes, 32 concurrent streams, half of them aborting
    python -m bench.soak --duration 30 --warmup 10 --out soak.jsonl   # the CI form (tests/acceptance)

Run from the repository root (`python -m` puts it on the import path).

The gateway (`fleet-gateway serve`, core 0) runs in front of a simulated vLLM replica (its own
process, core 1) that streams a short answer at 400 tokens/s. A load process keeps `--streams`
streams open at all times; `--abort` of them hang up after the first event (a client leaving
mid-answer). Every 5 s the gateway's RSS is sampled; a probe times `GET /health` every 50 ms (the
event loop's lag). At the end: RSS growth after the warm-up, the probe's percentiles, how many
streams completed, were cut or failed, and how many upstream connections were still open 5 s after
the load stopped (none may remain beyond the keep-alive pool). One JSON line to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.proxycost.constants import BENCH
from bench.proxycost.host import BenchError, Processes, free_port, pin, rss_mb, wait_ready
from bench.proxycost.report import percentile

BODY = json.dumps(
    {
        "model": "m",
        "messages": [{"role": "user", "content": "a story, please"}],
        "stream": True,
        "max_tokens": 64,
    }
).encode()


def routes(upstream: int) -> str:
    return f"""
defaults: {{min_max_tokens: 0, prefix: {{volatile: warn}}}}
presets:
  m:
    served_model: m
    replicas: [{{name: sim, url: "http://127.0.0.1:{upstream}", engine: vllm}}]
routing: {{default: m}}
"""


async def stream_once(port: int, abort: bool) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        writer.write(head + b"content-length: %d\r\n\r\n" % len(BODY) + BODY)
        received = b""
        while b"data: [DONE]" not in received and b'"error"' not in received:
            piece = await asyncio.wait_for(reader.read(65536), 30)
            if not piece:
                return "cut"
            received += piece
            if abort and b"data: {" in received:
                return "aborted"
        return "done" if b"data: [DONE]" in received else "error"
    except (OSError, TimeoutError):
        return "failed"
    finally:
        writer.close()


async def load(port: int, streams: int, abort: float, until: float) -> dict[str, int]:
    counts: dict[str, int] = {}
    rng = random.Random(7)

    async def worker() -> None:
        while time.monotonic() < until:
            outcome = await stream_once(port, rng.random() < abort)
            counts[outcome] = counts.get(outcome, 0) + 1

    await asyncio.gather(*(worker() for _ in range(streams)))
    return counts


async def probe(port: int, until: float) -> list[float]:
    lags = []
    while time.monotonic() < until:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        await reader.read()
        writer.close()
        lags.append((time.monotonic() - started) * 1000)
        await asyncio.sleep(0.05)
    return lags


def upstream_connections(gateway_pid: int, upstream: int) -> int:
    """ESTABLISHED TCP connections from the gateway process to the upstream port (/proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{gateway_pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and int(fields[2].split(":")[1], 16) == upstream and fields[9] in inodes:
            count += 1
    return count


def soak(duration: float, warmup: float, streams: int, abort: float) -> dict[str, Any]:
    processes = Processes()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            upstream, port = free_port(), free_port()
            sim = [sys.executable, "-m", "gateway.simulator", "--engine", "vllm", "--port", str(upstream)]
            sim += ["--model", "m", "--decode-tps", "400", "--answer-tokens", "24", "--slots", "64"]
            replica = processes.start("simulator", [*pin(1), *sim])
            wait_ready(upstream, "/health", replica, "simulator", 30)
            table = Path(tmp) / "routes.yaml"
            table.write_text(routes(upstream))
            env = {"GATEWAY_ROUTES": str(table), "GATEWAY_PORT": str(port), "GATEWAY_LOG_LEVEL": "warning"}
            gateway = processes.start(
                "gateway",
                [*pin(0), sys.executable, "-m", "gateway", "serve"],
                env={**os.environ, **env},
                stdout=subprocess.DEVNULL,  # the access log, one line per stream
            )
            wait_ready(port, "/health", gateway, "gateway", 30)
            return asyncio.run(_drive(gateway.pid, port, upstream, duration, warmup, streams, abort))
        finally:
            processes.close()


async def _drive(
    pid: int, port: int, upstream: int, duration: float, warmup: float, streams: int, abort: float
) -> dict[str, Any]:
    started = time.monotonic()
    until = started + duration
    samples: list[tuple[float, float]] = []

    async def sample() -> None:
        while time.monotonic() < until:
            samples.append((time.monotonic() - started, rss_mb(pid)))
            await asyncio.sleep(5)

    counts, lags, _ = await asyncio.gather(load(port, streams, abort, until), probe(port, until), sample())
    await asyncio.sleep(5)  # past the upstream keep-alive expiry: what is still open is a leak
    leftover = upstream_connections(pid, upstream)
    after_warmup = [rss for at, rss in samples if at >= warmup] or [samples[-1][1]]
    return {
        "bench": "soak",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "duration_s": duration,
        "warmup_s": warmup,
        "streams": streams,
        "abort": abort,
        "outcomes": counts,
        "rss_mb_after_warmup": round(after_warmup[0], 2),
        "rss_mb_end": round(after_warmup[-1], 2),
        "rss_growth_mb": round(after_warmup[-1] - after_warmup[0], 2),
        "rss_samples": [(round(at, 1), round(rss, 2)) for at, rss in samples],
        "lag_ms_p50": round(percentile(lags, 50), 2),
        "lag_ms_p99": round(percentile(lags, 99), 2),
        "lag_ms_max": round(max(lags), 2),
        "upstream_connections_after": leftover,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    parser.add_argument("--warmup", type=float, default=60, help="seconds before RSS growth is counted")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--abort", type=float, default=0.5, help="share of streams whose client hangs up")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "soak.jsonl")
    args = parser.parse_args()
    try:
        result = soak(args.duration, min(args.warmup, args.duration / 2), args.streams, args.abort)
    except BenchError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        out.write(json.dumps(result) + "\n")
    r = result
    print(f"{r['duration_s']:g} s, {args.streams} streams ({args.abort:.0%} aborting): {r['outcomes']}")
    print(
        f"RSS {r['rss_mb_after_warmup']} -> {r['rss_mb_end']} MB after warm-up"
        f" (growth {r['rss_growth_mb']} MB)"
    )
    print(f"/health p50 {r['lag_ms_p50']} ms, p99 {r['lag_ms_p99']} ms, max {r['lag_ms_max']} ms")
    # The health prober keeps one pooled connection alive (it asks every 5 s).
    print(f"upstream connections 5 s after the load: {r['upstream_connections_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
