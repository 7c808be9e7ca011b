"""What a team's limits and priority cost and buy: `python -m bench.team`.

    python -m bench.team [--quick] [--requests N] [--out FILE]

Two measurements, each side by side in one run, on 127.0.0.1:

`limits`: the added latency of a Redis-backed limit check. One simulated vLLM replica that answers
at once (16 tokens) behind two `fleet-gateway serve` processes with the same named key and limits
(requests and tokens per minute, too high to refuse): one counts in its own memory, the other
shares its counters through a real `redis-server` (`state.redis`). One client alternates between
them, one non-streaming request at a time on keep-alive connections. Reported: p50 and p95 of each,
their ratio, and the Redis round trips and commands per request (the gateway's
`gateway_redis_round_trips` counter, and Redis's own `total_commands_processed`, which counts the
commands the two Lua scripts run inside Redis too).

`priority`: an interactive request's queue wait under a batch load. One simulated replica with
real timing (2 slots, 20 answer tokens at 200 tokens/s: 0.1 s an answer), a preset with 2 places;
six batch clients keep it saturated while one interactive client sends a request every 0.3 s.
Three gateways in turn: `fifo` (the batch key declared interactive: one queue, arrival order),
`priority` (batch key, `batch_max_share: 1`: interactive requests go first in the queue only) and
`priority+share` (the default share 0.75: batch requests also leave a place free). Reported per
mode: the interactive requests' p50 and p95 answer time and the mean queue wait the gateway
recorded (`gateway_queue_wait_seconds`), and the batch answers completed meanwhile.

Results go to stdout and as JSON lines appended to --out (default bench/results/team.jsonl).
Every request must succeed; otherwise exit 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.proxycost.host import BenchError, Processes, free_port, run_fields, terminate_cleanly, wait_ready
from bench.proxycost.report import percentile

KEYS = {"alice": "bench-alice-key", "eval": "bench-eval-key"}
HIGH = {"requests_per_minute": 10_000_000, "tokens_per_minute": 1_000_000_000}


def key(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "key_sha256": hashlib.sha256(KEYS[name].encode()).hexdigest(), **fields}


def routes(sim_port: int, keys: list[dict[str, Any]], limits: dict[str, Any], redis: str | None) -> str:
    preset = {
        "served_model": "m",
        "limits": {"queue": 256, "queue_timeout": 120, **limits},
        "replicas": [{"name": "r0", "url": f"http://127.0.0.1:{sim_port}", "engine": "vllm"}],
    }
    table: dict[str, Any] = {"presets": {"m": preset}, "routing": {"default": "m"}, "keys": keys}
    if redis is not None:
        table["state"] = {"redis": redis}
    return json.dumps(table)


class Fleet:
    """The processes of one run; every one is stopped by `close`."""

    def __init__(self) -> None:
        self.procs = Processes()
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-team-"))

    def simulator(self, *flags: str) -> int:
        port = free_port()
        argv = [sys.executable, "-m", "gateway.simulator", "--engine", "vllm", "--port", str(port)]
        argv += ["--model", "m", "--reasoning-tokens", "0", *flags]
        proc = self.procs.start("simulator", argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(port, "/health", proc, "the simulator", 30)
        return port

    def redis(self) -> int:
        binary = shutil.which("redis-server")
        if binary is None:
            raise BenchError("redis-server is not installed (scripts/install-system installs it)")
        port = free_port()
        argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.tmp)]
        self.procs.start("redis", argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while redis_info(port) is None:
            if time.monotonic() > deadline:
                raise BenchError("redis-server did not answer within 10 s")
            time.sleep(0.05)
        return port

    def gateway(self, name: str, table: str) -> str:
        path = self.tmp / f"{name}.yaml"
        path.write_text(table)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env |= {"GATEWAY_ROUTES": str(path), "GATEWAY_HOST": "127.0.0.1", "GATEWAY_LOG_REQUESTS": "false"}
        argv = [sys.executable, "-m", "gateway", "serve", "--port", str(port)]
        proc = self.procs.start(name, argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(port, "/ready", proc, f"gateway {name}", 60)
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.procs.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def redis_info(port: int) -> dict[str, Any] | None:
    """Redis's `INFO stats`, or None while it does not answer."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    try:
        return dict(client.info("stats"))
    except redis.RedisError:
        return None
    finally:
        client.close()


def scrape(url: str, name: str, **labels: str) -> float:
    headers = {"authorization": f"Bearer {KEYS['alice']}"}
    response = httpx2.get(url + "/metrics", headers=headers, timeout=10)
    if response.status_code != 200:
        raise BenchError(f"/metrics answered {response.status_code}")
    text = response.text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def chat(client: httpx2.Client, url: str, who: str, content: str = "hello") -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 64}
    headers = {"authorization": f"Bearer {KEYS[who]}"}
    started = time.perf_counter()
    response = client.post(url + "/v1/chat/completions", json=body, headers=headers)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise BenchError(f"a request failed with {response.status_code}: {response.text[:200]}")
    return elapsed


def stats(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(values) * 1000, 3),
        "p95_ms": round(percentile(values, 95) * 1000, 3),
    }


def measure_limits(fleet: Fleet, requests: int) -> dict[str, Any]:
    sim = fleet.simulator("--time-scale", "0", "--answer-tokens", "16")
    redis_port = fleet.redis()
    keys = [key("alice", limits=HIGH)]
    urls = {
        "local": fleet.gateway("local", routes(sim, keys, {}, None)),
        "redis": fleet.gateway("redis", routes(sim, keys, {}, f"redis://127.0.0.1:{redis_port}/0")),
    }
    times: dict[str, list[float]] = {"local": [], "redis": []}
    with httpx2.Client(timeout=60) as client:
        for _ in range(20):  # unmeasured: connections, caches and the Lua scripts warm
            for url in urls.values():
                chat(client, url, "alice")
        trips_before = scrape(urls["redis"], "gateway_redis_round_trips_total")
        commands_before = int((redis_info(redis_port) or {}).get("total_commands_processed", 0))
        for _ in range(requests):
            for name, url in urls.items():
                times[name].append(chat(client, url, "alice"))
        time.sleep(0.2)  # the last answers' charges run just after their last byte
        trips = scrape(urls["redis"], "gateway_redis_round_trips_total") - trips_before
        commands = int((redis_info(redis_port) or {}).get("total_commands_processed", 0)) - commands_before
    figures: dict[str, Any] = {name: stats(values) for name, values in times.items()}
    figures["ratio_p50"] = round(figures["redis"]["p50_ms"] / figures["local"]["p50_ms"], 3)
    figures["added_p50_ms"] = round(figures["redis"]["p50_ms"] - figures["local"]["p50_ms"], 3)
    figures["round_trips_per_request"] = round(trips / requests, 3)
    figures["redis_commands_per_request"] = round(commands / requests, 3)
    return figures


MODES = {
    "fifo": ("interactive", 1.0),
    "priority": ("batch", 1.0),
    "priority+share": ("batch", 0.75),
}


def measure_priority(fleet: Fleet, interactive: int) -> dict[str, Any]:
    # 2 slots at 200 tokens/s, 20 tokens an answer: each answer holds its place 0.1 s.
    sim = fleet.simulator("--time-scale", "1", "--slots", "2", "--decode-tps", "200", "--answer-tokens", "20")
    results: dict[str, Any] = {}
    for mode, (batch_priority, share) in MODES.items():
        keys = [key("alice"), key("eval", priority=batch_priority)]
        url = fleet.gateway(mode, routes(sim, keys, {"max_in_flight": 2, "batch_max_share": share}, None))
        times, batch_answers = under_batch_load(url, interactive)
        waited = scrape(url, "gateway_queue_wait_seconds_sum", priority="interactive")
        count = scrape(url, "gateway_queue_wait_seconds_count", priority="interactive")
        results[mode] = {
            **stats(times),
            "queue_wait_mean_ms": round(waited / count * 1000, 3) if count else None,
            "batch_answers": batch_answers,
        }
    fifo, best = results["fifo"]["p50_ms"], results["priority+share"]["p50_ms"]
    results["fifo_over_priority_p50"] = round(fifo / best, 3) if best else None
    return results


def under_batch_load(url: str, interactive: int, batch_clients: int = 6) -> tuple[list[float], int]:
    """The interactive answer times while `batch_clients` keep the preset saturated; and how many
    batch answers came back meanwhile."""
    stop = threading.Event()
    done = [0] * batch_clients
    errors: list[BaseException] = []

    def batch(index: int) -> None:
        try:
            with httpx2.Client(timeout=120) as client:
                while not stop.is_set():
                    chat(client, url, "eval", content=f"batch {index}")
                    done[index] += 1
        except BaseException as exc:  # reported after the run: every request must succeed
            errors.append(exc)

    threads = [threading.Thread(target=batch, args=(i,), daemon=True) for i in range(batch_clients)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # the queue fills before the first interactive request
    times = []
    try:
        with httpx2.Client(timeout=120) as client:
            for _ in range(interactive):
                times.append(chat(client, url, "alice", content="interactive"))
                time.sleep(0.3)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    if errors:
        raise BenchError(f"a batch request failed: {errors[0]}")
    return times, sum(done)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, for CI")
    parser.add_argument("--requests", type=int, help="measured requests per gateway (default 300)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/team.jsonl"))
    args = parser.parse_args(argv)
    requests = args.requests or (30 if args.quick else 300)
    interactive = 8 if args.quick else 30
    fleet = Fleet()
    try:
        with terminate_cleanly():
            limits = measure_limits(fleet, requests)
            priority = measure_priority(fleet, interactive)
    except BenchError as exc:
        print(f"bench.team: {exc}", file=sys.stderr)
        return 1
    finally:
        fleet.close()
    base = {**run_fields("team", os.cpu_count() or 1, args.quick)}
    lines = [
        {**base, "measure": "limits", "requests": requests, **limits},
        {**base, "measure": "priority", "interactive": interactive, **priority},
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as handle:
        for line in lines:
            handle.write(json.dumps(line) + "\n")
    print(f"{'limit check':<16} {'p50 ms':>9} {'p95 ms':>9}")
    for name in ("local", "redis"):
        print(f"{name:<16} {limits[name]['p50_ms']:>9.3f} {limits[name]['p95_ms']:>9.3f}")
    print(
        f"redis / local (p50): {limits['ratio_p50']:.3f}, added {limits['added_p50_ms']:.3f} ms; "
        f"{limits['round_trips_per_request']:.2f} round trips and "
        f"{limits['redis_commands_per_request']:.2f} Redis commands per request"
    )
    print(f"\n{'interactive':<16} {'p50 ms':>9} {'p95 ms':>9} {'queue ms':>9} {'batch':>6}")
    for mode in MODES:
        row = priority[mode]
        wait = row["queue_wait_mean_ms"]
        wait_text = f"{wait:>9.1f}" if wait is not None else f"{'-':>9}"
        print(f"{mode:<16} {row['p50_ms']:>9.1f} {row['p95_ms']:>9.1f} {wait_text} {row['batch_answers']:>6}")
    print(f"fifo / priority+share (p50): {priority['fifo_over_priority_p50']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
