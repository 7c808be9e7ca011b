"""What tool-call repair costs on a stream: `python -m bench.tool_repair`.

    python -m bench.tool_repair [--quick] [--requests N] [--out FILE]

Two `fleet-gateway serve` processes side by side in one run, in front of the same two simulated
llama-server replicas (64 answer tokens at 1000 tokens/s, one token per event, no thinking): one
whose preset has the default compat (`off`: a request that declares tools still gets the unique-ids
change, which is on whatever the compat), one with `tool_call_repair` added (`repair`). One client
sends streaming chat and Messages requests, one at a time, alternating between the two gateways.

Cases, each in both dialects:
- `prose, no tools`: no change at work, the answer passes as the replica's bytes (the fast path);
- `prose, tools`: the same answer to a request that declares a tool (no call in it);
- `native call`: the engine parsed the call itself;
- `leaked call`: the call written as text in Qwen3-Coder's form (the second replica misbehaves):
  `repair` turns it into a call, `off` relays it as text.

Reported per case and gateway: the p50 and p95 of the time to the response's first body byte and
to its last, and the gateway process's CPU time per answer; and for `repair`, the differences from
`off`. Results go to stdout and as JSON lines appended to --out (default
bench/results/tool_repair.jsonl). Every answer is checked (a repaired call must arrive as a call).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from bench.proxycost.host import BenchError, Processes, cpu_seconds, free_port, run_fields, wait_ready
from bench.proxycost.report import percentile

FIXES = [
    "billing_header",
    "system_in_turns",
    "anthropic_only_fields",
    "codex_lite",
    "codex_tools",
    "reasoning_replay",
    "unknown_tool_types",
]
BASH = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
CALL_PROMPT = 'List the files [[tool Bash {"command": "ls -la"}]]'
PROSE_PROMPT = "Say something about rivers"
DIALECTS = ("chat", "messages")


@dataclass(frozen=True)
class Case:
    name: str
    replica: str  # "plain" or "leaky"
    tools: bool
    prompt: str
    call: bool  # the client must get a tool call (on `repair`; on `off` too unless leaked)


CASES = (
    Case("prose, no tools", "plain", False, PROSE_PROMPT, False),
    Case("prose, tools", "plain", True, PROSE_PROMPT, False),
    Case("native call", "plain", True, CALL_PROMPT, True),
    Case("leaked call", "leaky", True, CALL_PROMPT, True),
)


def table(plain: int, leaky: int, repair: bool) -> str:
    compat = FIXES + (["tool_call_repair"] if repair else [])
    presets = {
        name: {
            "served_model": "m",
            "compat": compat,
            "replicas": [{"name": name, "url": f"http://127.0.0.1:{port}", "engine": "llamacpp"}],
        }
        for name, port in (("plain", plain), ("leaky", leaky))
    }
    return json.dumps(
        {
            "defaults": {"max_tokens": 256, "min_max_tokens": 0},
            "presets": presets,
            "routing": {"default": "plain"},
        }
    )


class Fleet:
    """The processes of one run; every one is stopped by `close`."""

    def __init__(self) -> None:
        self.procs = Processes()
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-tool-repair-"))
        self.pids: dict[str, int] = {}

    def simulator(self, *flags: str) -> int:
        port = free_port()
        argv = [sys.executable, "-m", "gateway.simulator", "--engine", "llamacpp", "--port", str(port)]
        argv += ["--model", "m", "--reasoning-tokens", "0", "--answer-tokens", "64", "--decode-tps", "1000"]
        argv += ["--prefill-tps", "100000", *flags]
        proc = self.procs.start("simulator", argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(port, "/health", proc, "the simulator", 30)
        return port

    def gateway(self, name: str, routes: str) -> str:
        path = self.tmp / f"{name}.yaml"
        path.write_text(routes)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env |= {"GATEWAY_ROUTES": str(path), "GATEWAY_HOST": "127.0.0.1", "GATEWAY_LOG_REQUESTS": "false"}
        argv = [sys.executable, "-m", "gateway", "serve", "--port", str(port)]
        proc = self.procs.start(name, argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(port, "/ready", proc, f"gateway {name}", 60)
        self.pids[name] = proc.pid
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.procs.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def request(dialect: str, case: Case) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": case.prompt}]
    if dialect == "chat":
        body: dict[str, Any] = {"model": case.replica, "messages": messages, "stream": True}
        if case.tools:
            body["tools"] = [{"type": "function", "function": {"name": "Bash", "parameters": BASH}}]
        return "/v1/chat/completions", body
    body = {"model": case.replica, "messages": messages, "stream": True, "max_tokens": 256}
    if case.tools:
        body["tools"] = [{"name": "Bash", "input_schema": BASH}]
    return "/v1/messages", body


@dataclass
class Samples:
    first: list[float] = field(default_factory=list)
    last: list[float] = field(default_factory=list)
    cpu: float = 0.0


def one(client: httpx2.Client, url: str, dialect: str, case: Case, repair: bool) -> tuple[float, float]:
    path, body = request(dialect, case)
    started = time.perf_counter()
    first = 0.0
    data = b""
    with client.stream(
        "POST", url + path, json=body, headers={"anthropic-version": "2023-06-01"}
    ) as response:
        if response.status_code != 200:
            raise BenchError(f"{dialect} {case.name}: status {response.status_code}")
        for chunk in response.iter_raw():
            if not first:
                first = time.perf_counter() - started
            data += chunk
    last = time.perf_counter() - started
    called = b'"tool_calls"' in data if dialect == "chat" else b'"tool_use"' in data
    expected = case.call and (repair or case.replica == "plain")
    if called != expected:
        mode = "repair" if repair else "off"
        raise BenchError(f"{dialect} {case.name} on {mode}: tool call {called}, expected {expected}")
    return first, last


def stats(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(values) * 1000, 3),
        "p95_ms": round(percentile(values, 95) * 1000, 3),
    }


def run(requests: int, quick: bool, out: Path) -> int:
    fleet = Fleet()
    try:
        plain = fleet.simulator()
        leaky = fleet.simulator("--misbehave", "leak_xml")
        urls = {
            mode: fleet.gateway(mode, table(plain, leaky, mode == "repair")) for mode in ("off", "repair")
        }
        results: dict[tuple[str, str, str], Samples] = {}
        with httpx2.Client(timeout=60) as client:
            for dialect in DIALECTS:
                for case in CASES:
                    for mode in urls:  # a few answers each first: connections, caches, imports
                        for _ in range(3):
                            one(client, urls[mode], dialect, case, mode == "repair")
                    cpu = {mode: cpu_seconds(fleet.pids[mode]) for mode in urls}
                    for _ in range(requests):
                        for mode, url in urls.items():
                            first, last = one(client, url, dialect, case, mode == "repair")
                            samples = results.setdefault((dialect, case.name, mode), Samples())
                            samples.first.append(first)
                            samples.last.append(last)
                    for mode in urls:
                        results[(dialect, case.name, mode)].cpu = cpu_seconds(fleet.pids[mode]) - cpu[mode]
    finally:
        fleet.close()
    report(results, requests, quick, out)
    return 0


def report(results: dict[tuple[str, str, str], Samples], requests: int, quick: bool, out: Path) -> None:
    head = run_fields("tool_repair", len(os.sched_getaffinity(0)), quick)
    lines = []
    columns = ("first p50", "first p95", "last p50", "last p95", "cpu/answer")
    print(f"{'dialect':9} {'case':17} {'gateway':7} " + " ".join(f"{c:>10}" for c in columns))
    for (dialect, case, mode), samples in results.items():
        first, last = stats(samples.first), stats(samples.last)
        cpu_ms = round(samples.cpu / requests * 1000, 3)
        print(
            f"{dialect:9} {case:17} {mode:7} {first['p50_ms']:>8.2f}ms {first['p95_ms']:>8.2f}ms "
            f"{last['p50_ms']:>8.2f}ms {last['p95_ms']:>8.2f}ms {cpu_ms:>8.3f}ms"
        )
        entry: dict[str, Any] = {
            **head,
            "dialect": dialect,
            "case": case,
            "gateway": mode,
            "requests": requests,
        }
        entry |= {"first_byte": first, "last_byte": last, "cpu_ms_per_answer": cpu_ms}
        if mode == "repair":
            off = results[(dialect, case, "off")]
            entry["added_ms"] = {
                "first_p50": round(
                    (statistics.median(samples.first) - statistics.median(off.first)) * 1000, 3
                ),
                "last_p50": round((statistics.median(samples.last) - statistics.median(off.last)) * 1000, 3),
                "cpu_per_answer": round((samples.cpu - off.cpu) / requests * 1000, 3),
            }
            added = entry["added_ms"]
            print(
                f"{'':9} {'':17} {'added':7} {added['first_p50']:>+8.2f}ms {'':>10} "
                f"{added['last_p50']:>+8.2f}ms {'':>10} {added['cpu_per_answer']:>+8.3f}ms"
            )
        lines.append(json.dumps(entry))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as sink:
        sink.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 answers per case and gateway")
    parser.add_argument(
        "--requests", type=int, default=None, help="answers per case and gateway (default 100)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/tool_repair.jsonl"))
    args = parser.parse_args(argv)
    requests = args.requests or (20 if args.quick else 100)
    try:
        return run(requests, args.quick, args.out)
    except BenchError as error:
        print(f"bench.tool_repair: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
