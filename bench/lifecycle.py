"""What the supervisor of launched replicas costs a request, and how long a start takes.

    python -m bench.lifecycle [--requests 300] [--out FILE]

One `fleet-gateway serve` with two presets over the same kind of simulated replica (answers at
once): `fixed`, a replica the bench starts itself (no `launch`), and `launched`, the same simulator
started by the gateway for the first request (its cold start through the gateway is timed from the
client). Then one client alternates non-streaming requests between the two, one at a time, so both
run on the same gateway at the same moments; the ratio of their medians is the supervisor's cost on
the hot path of a resident replica. Nothing here is a bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx2

from bench.proxycost.host import Processes, free_port, run_fields, wait_ready
from bench.proxycost.report import percentile


def sim(port: int, model: str) -> list[str]:
    flags = ["--engine", "vllm", "--port", str(port), "--model", model, "--time-scale", "0"]
    return [sys.executable, "-m", "gateway.simulator", *flags]


def routes(fixed: int, launched: int) -> str:
    cmd = ", ".join(f'"{arg}"' for arg in sim(launched, "launched"))
    return f"""
devices: {{gpu0: 48}}
presets:
  fixed:
    served_model: fixed
    replicas: [{{name: f0, url: "http://127.0.0.1:{fixed}", engine: vllm}}]
  launched:
    served_model: launched
    replicas:
      - name: l0
        url: "http://127.0.0.1:{launched}"
        engine: vllm
        launch: {{cmd: [{cmd}], grace: 5}}
        uses: {{gpu0: 30}}
routing: {{default: fixed}}
"""


def request(http: httpx2.Client, url: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    started = time.perf_counter()
    response = http.post(url + "/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{model}: {response.status_code} {response.text[:200]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lifecycle", description=__doc__)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("bench-results.jsonl"))
    args = parser.parse_args()
    processes = Processes()
    try:
        fixed_port, launched_port, port = free_port(), free_port(), free_port()
        fixed = processes.start("fixed", sim(fixed_port, "fixed"))
        wait_ready(fixed_port, "/health", fixed, "fixed replica", 20)
        with tempfile.TemporaryDirectory() as tmp:
            table = Path(tmp) / "routes.yaml"
            table.write_text(routes(fixed_port, launched_port))
            env = {**os.environ, "GATEWAY_LOG_REQUESTS": "false", "GATEWAY_STATE_DIR": tmp}
            gateway = processes.start(
                "gateway",
                [sys.executable, "-m", "gateway", "serve", "--routes", str(table), "--port", str(port)],
                env=env,
            )
            wait_ready(port, "/health", gateway, "gateway", 30)
            url = f"http://127.0.0.1:{port}"
            with httpx2.Client(timeout=60) as http:
                cold = request(http, url, "launched")  # starts l0 and waits for it
                times: dict[str, list[float]] = {"fixed": [], "launched": []}
                for n in range(args.requests + 5):
                    for model in ("fixed", "launched"):
                        elapsed = request(http, url, model)
                        if n >= 5:  # a few unmeasured rounds warm both paths
                            times[model].append(elapsed)
    finally:
        processes.close()
    summary = {
        name: {
            "p50_ms": round(statistics.median(values) * 1000, 3),
            "p95_ms": round(percentile(values, 95) * 1000, 3),
        }
        for name, values in times.items()
    }
    record = {
        **run_fields("lifecycle", 1, False),
        "requests": args.requests,
        "cold_start_through_gateway_s": round(cold, 3),
        "paths": summary,
        "ratio_p50": round(summary["launched"]["p50_ms"] / summary["fixed"]["p50_ms"], 3),
    }
    print(json.dumps(record))
    with args.out.open("a") as out:
        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
