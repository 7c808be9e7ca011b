"""What a delegation over MCP adds to the same request sent as chat completions: `python -m bench.mcp`.

    python -m bench.mcp [--quick] [--requests N] [--out FILE]

Side by side in one run: one simulated vLLM replica (`time_scale=0`, 32 answer tokens) behind
`fleet-gateway serve` on 127.0.0.1 with the shipped defaults. Alternately, one at a time:
`delegate` through the official MCP client on one open session (`tools/call` round trip: JSON-RPC
over Streamable HTTP, the tool's in-process request, its SSE relay read back into text), and the
same messages as a streamed `/v1/chat/completions` request with httpx2 on a keep-alive connection
(read to `[DONE]`). Reported: median and p95 of each and their ratio, on stdout and as a JSON line
appended to --out (default bench/results/mcp.jsonl). Every call must succeed; otherwise exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from bench.proxycost.host import Processes, free_port, run_fields, wait_ready
from bench.proxycost.report import percentile

PROMPT = "Summarise the file in three bullet points."
CONTEXT = "def add(a, b):\n    return a + b\n" * 40


def routes(port: int) -> str:
    return f"""
presets:
  m:
    served_model: m
    replicas: [{{name: r0, url: "http://127.0.0.1:{port}", engine: vllm}}]
tasks: {{summarise: m}}
routing: {{default: m}}
"""


async def measure(url: str, requests: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"mcp": [], "chat": []}
    body = {
        "model": "m",
        "stream": True,
        "messages": [{"role": "user", "content": f"{CONTEXT}\n\n{PROMPT}"}],
    }
    async with (
        httpx2.AsyncClient(timeout=60) as http,
        streamable_http_client(url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        for n in range(requests + 2):  # two unmeasured rounds warm both paths
            started = time.perf_counter()
            result = await session.call_tool(
                "delegate", {"task": "summarise", "prompt": PROMPT, "context": CONTEXT}
            )
            mcp_s = time.perf_counter() - started
            if result.is_error:
                raise RuntimeError(f"delegate failed: {result.content}")
            started = time.perf_counter()
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
                tail = b""
                async for chunk in response.aiter_bytes():
                    tail = (tail + chunk)[-64:]
            chat_s = time.perf_counter() - started
            if response.status_code != 200 or b"[DONE]" not in tail:
                raise RuntimeError(f"chat completions failed: {response.status_code}")
            if n >= 2:
                times["mcp"].append(mcp_s)
                times["chat"].append(chat_s)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 requests each, for CI")
    parser.add_argument("--requests", type=int, help="measured requests per path (default 200)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/mcp.jsonl"))
    args = parser.parse_args(argv)
    requests = args.requests or (20 if args.quick else 200)
    procs = Processes()
    tmp = Path(tempfile.mkdtemp(prefix="bench-mcp-"))
    try:
        sim_port, gw_port = free_port(), free_port()
        python = sys.executable
        sim = procs.start(
            "simulator",
            [
                python,
                "-m",
                "gateway.simulator",
                "--engine",
                "vllm",
                "--port",
                str(sim_port),
                "--model",
                "m",
                "--time-scale",
                "0",
                "--reasoning-tokens",
                "0",
                "--answer-tokens",
                "32",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_ready(sim_port, "/health", sim, "the simulator", 30)
        (tmp / "routes.yaml").write_text(routes(sim_port))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env |= {"GATEWAY_ROUTES": str(tmp / "routes.yaml"), "GATEWAY_HOST": "127.0.0.1"}
        gateway = procs.start(
            "gateway",
            [python, "-m", "gateway", "serve", "--port", str(gw_port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_ready(gw_port, "/ready", gateway, "the gateway", 60)
        times = anyio.run(measure, f"http://127.0.0.1:{gw_port}", requests)
    finally:
        procs.close()
    figures: dict[str, Any] = {}
    for path, values in times.items():
        ordered = sorted(values)
        figures[path] = {
            "p50_ms": round(statistics.median(ordered) * 1000, 3),
            "p95_ms": round(percentile(ordered, 95) * 1000, 3),
        }
    ratio = round(figures["mcp"]["p50_ms"] / figures["chat"]["p50_ms"], 3)
    line = {**run_fields("mcp", os.cpu_count() or 1, args.quick), "requests": requests, **figures}
    line["ratio_p50"] = ratio
    line["added_p50_ms"] = round(figures["mcp"]["p50_ms"] - figures["chat"]["p50_ms"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as handle:
        handle.write(json.dumps(line) + "\n")
    print(f"{'path':<6} {'p50 ms':>9} {'p95 ms':>9}")
    for path in ("chat", "mcp"):
        print(f"{path:<6} {figures[path]['p50_ms']:>9.3f} {figures[path]['p95_ms']:>9.3f}")
    print(f"delegate / chat completions (p50): {ratio:.3f}, added {line['added_p50_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
