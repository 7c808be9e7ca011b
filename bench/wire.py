"""What a chat, an Anthropic Messages and a Responses stream cost through the gateway: `python -m bench.wire`.

    python -m bench.wire [--quick] [--rounds N] [--requests N] [--concurrency N] [--time-cap S] [--out FILE]

Side by side in one run, against the simulator with `time_scale=0` (the engine answers at once):
one simulated llama-server and one simulated vLLM replica, each reached directly (`direct`) and
through the gateway (`gateway`: `fleet-gateway serve` on 127.0.0.1, uvicorn with httptools,
shipped defaults, access log on, a routing table with one preset per replica). For each engine,
each wire format (`chat`: /v1/chat/completions, `messages`: /v1/messages?beta=true as Claude Code
calls it, `responses`: /v1/responses) and each body size (`first`: a first turn of ~80 KB, `late`:
~1 MB late in a session; bench/wirebodies.py builds them from the captured agent requests) it
measures a streaming request two ways:

* latency: one client, one request at a time on a keep-alive connection (40 per cell and round
  after 2 unmeasured ones; `--quick`: 6 after 1); time to first byte (the first byte of the
  answer's head, counted from the first byte of the request sent) and time to last byte (the
  stream's last chunk), as percentiles;
* throughput: `--concurrency` clients on keep-alive connections, `--requests` requests in all:
  requests/s, and the gateway's CPU time per request (from /proc).

Every answer must be a 200 whose stream ends as its format ends (`data: [DONE]`, `message_stop`,
`response.completed`); the run counts each status and each incomplete stream. Direct and gateway
alternate within each round, over `--rounds` rounds (figures: the median round for requests/s, all
rounds' samples for percentiles). The gateway runs on core 0, the replicas and this client on core 1
(when taskset and two cores exist).

Results: a table of gateway/direct ratios on stdout and JSON lines appended to --out (default
bench/results/wire.jsonl): one `cell` line per engine, format, size and path, one `ratio` line per
engine, format and size, and one `replica` line per simulated replica: the requests it counted
beside those this run sent it (none may be lost or repeated). Before the rounds, each cell gets
one unmeasured request on each path. The run stops at `--time-cap` seconds; cells not measured by then are
missing from the output and the exit status is 1, as it is when any request failed. Every process it
started is stopped before it exits, also on SIGTERM. Run it from the repository root. `--quick` is
the CI form (tests/bench/test_bench.py), which checks what it reports and never how fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import httptools

from bench.proxycost.constants import BENCH
from bench.proxycost.host import (
    CORES,
    PINNED,
    BenchError,
    Noise,
    Processes,
    cpu_model,
    cpu_seconds,
    free_port,
    pin,
    run_fields,
    terminate_cleanly,
    wait_ready,
)
from bench.proxycost.report import percentile
from bench.wirebodies import SIZES, build

DEFAULT_OUT = BENCH / "results" / "wire.jsonl"
ENGINES = ("llamacpp", "vllm")
APIS = ("chat", "messages", "responses")
PATHS = ("direct", "gateway")
MODEL = {"llamacpp": "sim-llama", "vllm": "sim-vllm"}  # preset name == served model: same bytes both ways
ENDPOINT = {
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages?beta=true",
    "responses": "/v1/responses",
}
END_OF_STREAM = {
    "chat": b"data: [DONE]",
    "messages": b"event: message_stop",
    "responses": b"response.completed",
}
HEADERS = {
    "chat": {},
    "messages": {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "x-app": "cli",
    },
    "responses": {"originator": "codex_exec"},
}
REQUEST_TIMEOUT = 30.0
QUANTILES = (50, 90, 99)


@dataclass
class Plan:
    quick: bool
    rounds: int
    latency_requests: int  # per cell and round, one at a time
    requests: int  # per cell and round, for requests/s
    concurrency: int
    warmup: int  # per cell and round, before the latency samples
    time_cap: float


def plan_for(args: argparse.Namespace) -> Plan:
    if args.quick:
        plan = Plan(True, rounds=1, latency_requests=6, requests=8, concurrency=4, warmup=1, time_cap=100)
    else:
        plan = Plan(False, rounds=3, latency_requests=40, requests=80, concurrency=8, warmup=2, time_cap=170)
    for name in ("rounds", "requests", "concurrency", "time_cap"):
        if getattr(args, name) is not None:
            setattr(plan, name, getattr(args, name))
    return plan


# --- the client: raw asyncio, httptools parses the answers ----------------------------------------


@dataclass
class Sample:
    status: int
    sent: float  # perf_counter before the request's first byte was written
    first: float  # ... when the answer's first byte arrived
    last: float  # ... when its last byte arrived
    complete: bool  # the stream ended as its format ends


class Connection(asyncio.Protocol):
    """One keep-alive connection; `request` writes a whole request and waits for the whole answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: Any = None
        self.waiter: asyncio.Future[None] | None = None
        self.first: float | None = None
        self.last = 0.0
        self.body: list[bytes] = []
        self.lost = False
        self.keep_alive = True

    @classmethod
    async def open(cls, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        _, connection = await asyncio.wait_for(
            loop.create_connection(cls, "127.0.0.1", port), timeout=REQUEST_TIMEOUT
        )
        return connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(exc or ConnectionError("the server closed the connection"))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"connection" and value.lower() == b"close":
            self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.last = time.perf_counter()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def request(self, data: bytes, marker: bytes) -> Sample:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter = asyncio.get_running_loop().create_future()
        self._reset()
        sent = time.perf_counter()
        self.transport.write(data)
        await asyncio.wait_for(self.waiter, timeout=REQUEST_TIMEOUT)
        status = int(self.parser.get_status_code())
        body = b"".join(self.body)
        if not self.keep_alive:
            self.close()
        assert self.first is not None
        return Sample(status, sent, self.first, self.last, marker in body)

    def _reset(self) -> None:
        self.first, self.body, self.keep_alive = None, [], True

    def close(self) -> None:
        self.lost = True  # at once: `connection_lost` comes a loop iteration later
        if self.transport is not None:
            self.transport.close()


def http_request(api: str, body: bytes) -> bytes:
    head = [f"POST {ENDPOINT[api]} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json"]
    head += [f"{name}: {value}" for name, value in HEADERS[api].items()]
    head.append(f"content-length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


# --- the cells ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    engine: str
    api: str
    size: str
    path: str

    @property
    def pair(self) -> tuple[str, str, str]:
        return self.engine, self.api, self.size


@dataclass
class Measured:
    """One cell over all rounds."""

    body_bytes: int = 0
    ttfb_ms: list[float] = field(default_factory=list)
    ttlb_ms: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)  # one per round
    gateway_cpu_s: float = 0.0  # the gateway's CPU time over this cell's requests (gateway path)
    gateway_requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    incomplete: int = 0
    errors: list[str] = field(default_factory=list)
    rounds: int = 0

    def count(self, sample: Sample) -> None:
        self.statuses[sample.status] += 1
        self.incomplete += sample.status == 200 and not sample.complete

    @property
    def requests(self) -> int:
        return sum(self.statuses.values()) + len(self.errors)

    @property
    def answered_200(self) -> int:
        return self.statuses[200]


def stats(values: list[float]) -> dict[str, float]:
    return {f"p{q}": round(percentile(values, q), 4) for q in QUANTILES}


class Wire:
    """The replicas, the gateway and the measurement: everything started in `start`, stopped in `close`."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.procs = Processes()
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-wire-"))
        self.ports: dict[str, int] = {}
        self.gateway_port = 0
        self.gateway_pid = 0
        self.bodies: dict[tuple[str, str, str], bytes] = {}
        self.results: dict[Cell, Measured] = {}
        self.files: list[IO[bytes]] = []
        self.sent: Counter[str] = Counter()

    def start(self) -> None:
        python = sys.executable
        for engine in ENGINES:
            port = free_port()
            argv = [python, "-m", "gateway.simulator", "--engine", engine, "--port", str(port)]
            argv += ["--model", MODEL[engine], "--time-scale", "0", "--context", str(2**20)]
            argv += ["--slots", "16", "--reasoning-tokens", "0", "--answer-tokens", "32"]
            self.ports[engine] = port
            replica = self.procs.start(
                f"simulator ({engine})",
                [*pin(1), *argv],
                stdout=subprocess.DEVNULL,
                stderr=self._file(engine),
            )
            wait_ready(port, "/health", replica, f"the {engine} simulator", 30)
        routes = self.tmp / "routes.yaml"
        routes.write_text(routes_yaml(self.ports))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}  # shipped defaults
        env |= {
            "GATEWAY_ROUTES": str(routes),
            "GATEWAY_HOST": "127.0.0.1",
            "GATEWAY_LOG_REQUESTS": "true",
            "GATEWAY_DRAIN_SECONDS": "1",
        }
        exe = Path(python).parent / "fleet-gateway"
        command = [str(exe)] if exe.exists() else [python, "-m", "gateway"]
        self.gateway_port = free_port()
        gateway = self.procs.start(
            "gateway",
            [*pin(0), *command, "serve", "--port", str(self.gateway_port)],
            env=env,
            stdout=subprocess.DEVNULL,  # the access log, on as shipped, to nowhere
            stderr=self._file("gateway"),
        )
        self.gateway_pid = gateway.pid
        try:
            wait_ready(self.gateway_port, "/ready", gateway, "the gateway", 60)
        except BenchError as exc:
            raise BenchError(f"{exc}\n{(self.tmp / 'gateway.err').read_text()[-3000:]}") from None
        for engine in ENGINES:
            for api in APIS:
                for size in SIZES:
                    self.bodies[engine, api, size] = http_request(api, build(api, size, MODEL[engine]))

    def _file(self, name: str) -> IO[bytes]:
        handle = (self.tmp / f"{name}.err").open("wb")
        self.files.append(handle)
        return handle

    def close(self) -> None:
        self.procs.close()
        for handle in self.files:
            handle.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def port(self, cell: Cell) -> int:
        return self.gateway_port if cell.path == "gateway" else self.ports[cell.engine]

    async def measure(self, deadline: float) -> bool:
        """Every cell, round after round; False when the time cap stopped it early."""
        plan = self.plan
        for engine, api, size in self.bodies:  # one unmeasured request per cell: imports, caches, pools
            for path in PATHS:
                cell = Cell(engine, api, size, path)
                await self.send(Client(self.port(cell)), cell, Measured())
        for number in range(plan.rounds):
            print(f"round {number + 1}/{plan.rounds}", file=sys.stderr, flush=True)
            for engine, api, size in self.bodies:
                # Alternate which path goes first, so drift is shared out.
                for path in PATHS if number % 2 == 0 else PATHS[::-1]:
                    if time.monotonic() > deadline:
                        return False
                    await self.cell(Cell(engine, api, size, path))
        return True

    async def send(self, client: Client, cell: Cell, result: Measured) -> Sample | None:
        """One request; a failure is counted and the connection dropped (the next one reconnects)."""
        self.sent[cell.engine] += 1
        try:
            sample = await client.request(self.bodies[cell.pair], END_OF_STREAM[cell.api])
        except (OSError, TimeoutError) as exc:
            result.errors.append(f"{type(exc).__name__}: {exc}")
            client.close()
            return None
        result.count(sample)
        return sample

    async def cell(self, cell: Cell) -> None:
        plan = self.plan
        result = self.results.setdefault(cell, Measured())
        data = self.bodies[cell.pair]
        result.body_bytes = len(data) - data.index(b"\r\n\r\n") - 4
        result.rounds += 1
        port = self.port(cell)
        cpu = cpu_seconds(self.gateway_pid)

        # Latency: one client, one request at a time.
        client = Client(port)
        try:
            for i in range(plan.warmup + plan.latency_requests):
                sample = await self.send(client, cell, result)
                if sample is not None and i >= plan.warmup:
                    result.ttfb_ms.append((sample.first - sample.sent) * 1000)
                    result.ttlb_ms.append((sample.last - sample.sent) * 1000)
        finally:
            client.close()

        # Throughput: `concurrency` clients share `requests` requests.
        left = plan.requests

        async def load() -> None:
            nonlocal left
            client = Client(port)
            try:
                while left > 0:
                    left -= 1
                    await self.send(client, cell, result)
            finally:
                client.close()

        started = time.perf_counter()
        await asyncio.gather(*(load() for _ in range(min(plan.concurrency, plan.requests))))
        result.rps.append(plan.requests / (time.perf_counter() - started))
        if cell.path == "gateway":
            result.gateway_cpu_s += cpu_seconds(self.gateway_pid) - cpu
            result.gateway_requests += plan.warmup + plan.latency_requests + plan.requests

    def replica_counts(self) -> dict[str, dict[str, int]]:
        """What each replica saw (its /sim/stats counters) beside what this run sent it, both ways."""
        counts = {}
        for engine, port in self.ports.items():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/stats", timeout=30) as answer:
                seen = json.loads(answer.read())
            counts[engine] = {"sent": self.sent[engine]} | {
                key: int(seen[key]) for key in ("requests", "completed", "errors", "aborted")
            }
        return counts


class Client:
    """A keep-alive connection, opened when first needed and again after a failure."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connection: Connection | None = None

    async def request(self, data: bytes, marker: bytes) -> Sample:
        if self.connection is None or self.connection.lost:
            self.connection = await Connection.open(self.port)
        return await self.connection.request(data, marker)

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()


def routes_yaml(ports: dict[str, int]) -> str:
    # One preset per simulated replica, named as the replica serves its model, shipped defaults.
    presets = "\n".join(
        f"""  {MODEL[engine]}:
    served_model: {MODEL[engine]}
    replicas: [{{name: {engine}, url: "http://127.0.0.1:{port}", engine: {engine}}}]"""
        for engine, port in ports.items()
    )
    return f"presets:\n{presets}\nrouting: {{default: {MODEL['vllm']}}}\n"


# --- the report -----------------------------------------------------------------------------------


def cell_line(cell: Cell, result: Measured) -> dict[str, Any]:
    line: dict[str, Any] = {
        "kind": "cell",
        "engine": cell.engine,
        "api": cell.api,
        "size": cell.size,
        "path": cell.path,
        "body_bytes": result.body_bytes,
        "rounds": result.rounds,
        "requests": result.requests,
        "statuses": {str(status): n for status, n in sorted(result.statuses.items())},
        "answered_200": result.answered_200,
        "incomplete": result.incomplete,
        "errors": len(result.errors),
        "error_examples": result.errors[:3],
        "rps": round(statistics.median(result.rps), 2) if result.rps else None,
        "rps_rounds": [round(r, 2) for r in result.rps],
        "ttfb_ms": stats(result.ttfb_ms),
        "ttlb_ms": stats(result.ttlb_ms),
        "latency_samples": len(result.ttlb_ms),
    }
    if cell.path == "gateway":
        line["gateway_cpu_ms_per_request"] = round(
            result.gateway_cpu_s / max(1, result.gateway_requests) * 1000, 4
        )
    return line


def ratio_line(direct: dict[str, Any], gateway: dict[str, Any]) -> dict[str, Any]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(b / a, 4) if a and b is not None else None

    line: dict[str, Any] = {
        "kind": "ratio",
        "engine": direct["engine"],
        "api": direct["api"],
        "size": direct["size"],
        "body_bytes": direct["body_bytes"],
        "rps": ratio(direct["rps"], gateway["rps"]),
    }
    for metric in ("ttfb_ms", "ttlb_ms"):
        for q in QUANTILES:
            key = f"p{q}"
            line[f"{metric[:4]}_{key}"] = ratio(direct[metric][key], gateway[metric][key])
            if q == 50:
                line[f"{metric[:4]}_{key}_added_ms"] = round(gateway[metric][key] - direct[metric][key], 4)
    line["gateway_cpu_ms_per_request"] = gateway.get("gateway_cpu_ms_per_request")
    return line


def table(cells: dict[tuple[str, str, str, str], dict[str, Any]], ratios: list[dict[str, Any]]) -> str:
    """One row per engine, format and size: direct, gateway and the ratio gateway/direct."""
    top = (
        f"{'':29}{'requests/s':^24}  {'TTFB p50, ms':^24}  {'TTLB p50, ms':^33}  {'TTLB p99':>8}"
        f"  {'gateway':>10}"
    )
    head = (
        f"{'engine':9} {'api':10} {'body':>8}  {'direct':>8} {'gateway':>8} {'ratio':>6}"
        f"  {'direct':>8} {'gateway':>8} {'ratio':>6}  {'direct':>8} {'gateway':>8} {'ratio':>6} {'added':>8}"
        f"  {'ratio':>8}  {'CPU ms/req':>10}"
    )
    rows = [top, head, "-" * len(head)]
    for line in ratios:
        key = (line["engine"], line["api"], line["size"])
        direct, gateway = cells[(*key, "direct")], cells[(*key, "gateway")]
        kb = f"{line['body_bytes'] / 1000:,.0f} KB"
        cpu = line["gateway_cpu_ms_per_request"]
        rows.append(
            f"{line['engine']:9} {line['api']:10} {kb:>8}"
            f"  {direct['rps']:8,.1f} {gateway['rps']:8,.1f} {_x(line['rps']):>6}"
            f"  {direct['ttfb_ms']['p50']:8.3f} {gateway['ttfb_ms']['p50']:8.3f} {_x(line['ttfb_p50']):>6}"
            f"  {direct['ttlb_ms']['p50']:8.3f} {gateway['ttlb_ms']['p50']:8.3f} {_x(line['ttlb_p50']):>6}"
            f" {line['ttlb_p50_added_ms']:+8.2f}  {_x(line['ttlb_p99']):>8}"
            f"  {'-' if cpu is None else f'{cpu:.2f}':>10}"
        )
    return "\n".join(rows)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.wire", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: 1 round, a few requests per cell")
    parser.add_argument("--rounds", type=int, help="rounds over every cell (default 3, quick 1)")
    parser.add_argument(
        "--requests", type=int, help="requests per cell and round for requests/s (default 80, quick 8)"
    )
    parser.add_argument("--concurrency", type=int, help="clients for requests/s (default 8, quick 4)")
    parser.add_argument(
        "--time-cap", type=float, help="seconds the measurement may take (default 170, quick 100)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON lines, appended (default {DEFAULT_OUT})"
    )
    args = parser.parse_args()
    plan = plan_for(args)
    if min(plan.rounds, plan.requests, plan.concurrency) < 1 or plan.time_cap <= 0:
        parser.error("--rounds, --requests, --concurrency and --time-cap must be positive")
    nproc = len(os.sched_getaffinity(0))
    if PINNED:
        os.sched_setaffinity(0, {CORES[1]})  # this client and the replicas share core 1
    else:
        print("warning: no taskset or a single core: nothing is pinned", file=sys.stderr)
    common = {
        **run_fields("wire", nproc, plan.quick),
        "plan": {
            "rounds": plan.rounds,
            "warmup": plan.warmup,
            "latency_requests": plan.latency_requests,
            "requests": plan.requests,
            "concurrency": plan.concurrency,
            "time_cap_s": plan.time_cap,
        },
    }
    began = time.monotonic()
    load = Noise()
    wire = Wire(plan)
    with terminate_cleanly():
        try:
            wire.start()
            import uvloop

            finished = uvloop.run(wire.measure(time.monotonic() + plan.time_cap))
            replicas = wire.replica_counts()
        except (BenchError, OSError) as exc:
            print(f"bench.wire: {exc}", file=sys.stderr)
            return 1
        finally:
            wire.close()
    wall = time.monotonic() - began
    noise = load.report()
    cells = {
        (c.engine, c.api, c.size, c.path): cell_line(c, r)
        for c, r in wire.results.items()
        if r.rounds == plan.rounds
    }
    ratios = [
        ratio_line(cells[(*pair, "direct")], cells[(*pair, "gateway")])
        for pair in dict.fromkeys(key[:3] for key in cells)
        if (*pair, "direct") in cells and (*pair, "gateway") in cells
    ]
    seen = [{"kind": "replica", "engine": engine, **counts} for engine, counts in replicas.items()]
    lines = [*cells.values(), *ratios, *seen]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for line in lines:
            out.write(json.dumps({**common, **line, "wall_s": round(wall, 1), "noise": noise}) + "\n")
    print(table(cells, ratios))
    commit = f"{common['commit']}" + ("+dirty" if common["dirty"] else "")
    print(
        f"\n{common['date']}  {platform.machine()}, {nproc} cores ({cpu_model()})  commit {commit}"
        f"  {common['mode']}: {plan.rounds} round(s); per cell and round {plan.latency_requests} requests"
        f" at 1 client, {plan.requests} at {plan.concurrency}  wall {wall:.0f} s  -> {args.out}"
    )
    print(
        f"other load on the machine meanwhile: {noise['foreign_cpu_s']} CPU-s"
        f" ({noise['foreign_cores']:.2f} of a core on average), VM steal {noise['steal_s']} s"
    )
    failed = [
        line for line in cells.values() if line["answered_200"] != line["requests"] or line["incomplete"]
    ]
    for line in failed:
        print(
            f"FAILED: {line['engine']} {line['api']} {line['size']} {line['path']}:"
            f" statuses {line['statuses']},"
            f" {line['incomplete']} incomplete, {line['errors']} errors {line['error_examples']}",
            file=sys.stderr,
        )
    lost = [
        line
        for line in seen
        if not line["sent"] == line["requests"] == line["completed"] or line["errors"] or line["aborted"]
    ]
    for line in lost:
        print(f"FAILED: the {line['engine']} replica: {line}", file=sys.stderr)
    wanted = len(ENGINES) * len(APIS) * len(SIZES) * len(PATHS)
    if not finished or len(cells) < wanted:
        print(
            f"bench.wire: the time cap ({plan.time_cap:g} s) stopped the run: {len(cells)}/{wanted} cells",
            file=sys.stderr,
        )
        return 1
    return 1 if failed or lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
