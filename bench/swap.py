"""Two presets sharing one device, asked for in turn: the swap scheduler against arrival order.

    python -m bench.swap [--requests 48] [--interval 0.25] [--pattern ab] [--max-wait 5] [--load-seconds 3]

Two real llama-server replicas (the tiny GGUF) that the gateway launches, each needing 30 of the
device's 48 GiB, so only one is resident at a time. `--requests` requests arrive one every
`--interval` seconds, the presets in the order `--pattern` repeats (`ab`: alternating; `aaaaab`: a
steady stream for one with an occasional request for the other), non-streaming, a few tokens each; each engine
start is delayed by `--load-seconds` (the tiny model loads in 0.3 s, a real one in a minute). Run twice
on the same machine: once with the scheduler (`min_resident: 30`, `max_wait: --max-wait`) and once
in strict arrival order (`min_resident: 0`, `max_wait: 0`: every request for the other preset
drains the resident one at once). Reported per mode: swaps (evictions), total seconds, and the p50
and p95 of each request's time from sending to its answer.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2

from bench.proxycost.host import free_port, run_fields
from bench.proxycost.report import percentile


def table(
    binary: Path,
    model: Path,
    ports: tuple[int, int],
    min_resident: float,
    max_wait: float,
    load_seconds: float,
) -> str:
    replicas = []
    for name, port in zip(("a", "b"), ports, strict=True):
        flags = ["--host", "127.0.0.1", "--port", str(port), "-c", "2048", "-np", "2"]
        argv = [str(binary), "-m", str(model), *flags]
        if load_seconds:  # a real model's load time in front of the tiny one's (a 27B takes ~60 s)
            argv = ["/bin/sh", "-c", f'sleep {load_seconds:g}; exec "$0" "$@"', *argv]
        cmd = ", ".join(json.dumps(a) for a in argv)  # JSON strings are YAML strings
        env = f'{{LD_LIBRARY_PATH: "{binary.parent}"}}'
        replicas.append(
            f'  {name}: {{served_model: tiny, replicas: [{{name: {name}0, url: "http://127.0.0.1:{port}", '
            f"engine: llamacpp, launch: {{cmd: [{cmd}], env: {env}, grace: 5}}, uses: {{gpu0: 30}}}}]}}"
        )
    body = "\n".join(replicas)
    return f"""
devices: {{gpu0: 48}}
defaults: {{min_max_tokens: 0, min_resident: {min_resident}, max_wait: {max_wait}, timeouts: {{load: 300}}}}
health: {{interval: 1, timeout: 1}}
presets:
{body}
routing: {{default: a}}
"""


def run(routes: str, requests: int, interval: float, pattern: str) -> dict[str, Any]:
    """Open loop: one request every `interval` seconds, presets in the order `pattern` repeats,
    each answered on its own thread, so requests for both presets wait at the same time."""
    from bench.support.gateway import run_gateway

    times: list[float] = []
    statuses: list[int] = []
    with tempfile.TemporaryDirectory() as tmp, run_gateway(routes, state_dir=Path(tmp)) as gw:

        def one(model: str) -> None:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            started = time.perf_counter()
            response = httpx2.post(gw.url + "/v1/chat/completions", json=body, timeout=300)
            times.append(time.perf_counter() - started)
            statuses.append(response.status_code)

        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(requests) as pool:
            futures = []
            for n in range(requests):
                futures.append(pool.submit(one, pattern[n % len(pattern)]))
                time.sleep(interval)
            for future in futures:
                future.result()
        total = time.perf_counter() - began
        units = gw.gateway.supervisor.units
        swaps = sum(u.evictions for u in units.values())
        loads = sum(u.loads for u in units.values())
    return {
        "swaps": swaps,
        "loads": loads,
        "total_s": round(total, 2),
        "p50_s": round(statistics.median(times), 3),
        "p95_s": round(percentile(times, 95), 3),
        "ok": statuses.count(200),
        "requests": len(statuses),
    }


def main() -> None:
    from bench.support.engines import ensure_gguf, llama_server_binary

    parser = argparse.ArgumentParser(prog="python -m bench.swap", description=__doc__)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between two arrivals")
    parser.add_argument(
        "--pattern", default="ab", help="the presets in arrival order, repeated (e.g. aaaaab)"
    )
    parser.add_argument("--max-wait", type=float, default=5.0)
    parser.add_argument("--load-seconds", type=float, default=3.0, help="added before each engine start")
    parser.add_argument("--out", type=Path, default=Path("bench-results.jsonl"))
    args = parser.parse_args()
    binary, model = llama_server_binary(), ensure_gguf()
    results = {}
    for mode, (min_resident, max_wait) in {
        "scheduler": (30.0, args.max_wait),
        "arrival_order": (0.0, 0.0),
    }.items():
        ports = (free_port(), free_port())
        routes = table(binary, model, ports, min_resident, max_wait, args.load_seconds)
        results[mode] = run(routes, args.requests, args.interval, args.pattern)
        print(mode, json.dumps(results[mode]), flush=True)
    record = {
        **run_fields("swap", 1, False),
        "settings": {
            "requests": args.requests,
            "interval": args.interval,
            "pattern": args.pattern,
            "max_wait": args.max_wait,
            "load_seconds": args.load_seconds,
        },
        **results,
    }
    with args.out.open("a") as out:
        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
