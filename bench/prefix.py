"""How well the fleet's prefix caches hit, with and without the gateway: `python -m bench.prefix`.

A coding-agent workload: N concurrent conversations that grow turn by turn, each with a long
system prompt and a tool list, optionally with a per-request timestamp in the system prompt (as
careless clients do). For each scenario it reports the cache hit ratio (cached / prompt tokens, as
the replicas report them), the tokens actually prefilled, TTFT percentiles and how the requests
spread over the replicas.

    python -m bench.prefix --backend sim             # simulated replicas, larger scale
    python -m bench.prefix --backend llama           # two real llama-server replicas (tiny GGUF)
    python -m bench.prefix --backend llama --quick   # a few conversations, under a minute

Run from the repository root: it imports `gateway` and the test helpers in `tests/`.

Results: a table on stdout and JSON lines (one per scenario) appended to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from bench.proxycost.constants import BENCH

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} in the working tree",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    }
    for name in ("read_file", "write_file", "list_dir", "run_tests", "search_code")
]


@dataclass(frozen=True)
class Scenario:
    name: str
    target: str  # "direct" (one replica, no gateway) or "gateway"
    policy: str = "round_robin"
    volatile: str = "off"
    timestamp: bool = True


SCENARIOS = (
    Scenario("ideal: stable prompt, direct to one replica", "direct", timestamp=False),
    Scenario("timestamp, direct to one replica", "direct"),
    Scenario("timestamp, gateway round_robin", "gateway"),
    Scenario("timestamp, gateway round_robin + move", "gateway", volatile="move"),
    Scenario("timestamp, gateway least_busy + move", "gateway", policy="least_busy", volatile="move"),
    Scenario(
        "timestamp, gateway prefix_affinity + move", "gateway", policy="prefix_affinity", volatile="move"
    ),
    Scenario("stable, gateway round_robin", "gateway", timestamp=False),
    Scenario("stable, gateway prefix_affinity", "gateway", policy="prefix_affinity", timestamp=False),
)


@dataclass
class Result:
    scenario: str
    backend: str
    conversations: int
    turns: int
    replicas: int
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    by_replica: Counter[str] = field(default_factory=Counter)
    error_kinds: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.ttft_ms)
        out = asdict(self)
        out.pop("ttft_ms")
        out["by_replica"] = dict(self.by_replica)
        out["error_kinds"] = dict(self.error_kinds)
        out["prefilled_tokens"] = self.prompt_tokens - self.cached_tokens
        out["hit_ratio"] = round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0
        out["ttft_p50_ms"] = round(statistics.median(ttft), 2) if ttft else None
        out["ttft_p95_ms"] = round(ttft[int(0.95 * (len(ttft) - 1))], 2) if ttft else None
        out["max_replica_share"] = (
            round(max(self.by_replica.values()) / self.requests, 3)
            if self.by_replica and self.requests
            else None
        )
        return out


def system_prompt(conversation: int, words: int) -> str:
    # Two agent "products", each with its own long prompt, as a team's agents have.
    rng = random.Random(conversation % 2)
    vocabulary = [
        "repository",
        "function",
        "module",
        "tests",
        "commit",
        "review",
        "style",
        "error",
        "refactor",
    ]
    body = " ".join(rng.choice(vocabulary) for _ in range(words))
    return f"You are coding agent #{conversation % 2}. Follow these rules. {body}"


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{time.time_ns() % 1_000_000:06d}Z"


async def converse(
    http: httpx2.AsyncClient,
    url: str,
    model: str,
    index: int,
    turns: int,
    scenario: Scenario,
    result: Result,
    words: int,
) -> None:
    stable = system_prompt(index, words)
    rng = random.Random(1000 + index)
    history: list[dict[str, Any]] = []
    for turn in range(turns):
        # Careless clients put the time first, so nothing after it can ever be cached.
        system = (f"Current time: {stamp()}\n" if scenario.timestamp else "") + stable
        # Agents' turns carry tool output: the conversation's own prefix soon outgrows the system prompt.
        output = " ".join(
            rng.choice(("def", "class", "return", "import", "self", "value", "test"))
            for _ in range(words // 3)
        )
        history.append(
            {"role": "user", "content": f"Conversation {index}, step {turn}. Tool output:\n{output}"}
        )
        body = {
            "model": model,
            "messages": [{"role": "system", "content": system}, *history],
            "tools": TOOLS,
            "tool_choice": "none",
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        first: float | None = None
        content: list[str] = []
        usage: dict[str, Any] = {}
        try:
            # A new connection per request: llama-server closes one after a stream while advertising
            # keep-alive, and a direct client must not trip over that (the gateway handles it).
            async with http.stream("POST", url, json=body, headers={"connection": "close"}) as response:
                if response.status_code != 200:
                    await response.aread()
                    result.errors += 1
                    result.error_kinds[f"{response.status_code}: {response.text[:120]}"] += 1
                    continue
                replica = response.headers.get("x-gateway-replica", "direct")
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            first = first or time.perf_counter()
                            content.append(piece)
        except httpx2.HTTPError as exc:
            result.errors += 1
            result.error_kinds[type(exc).__name__] += 1
            continue
        result.requests += 1
        result.by_replica[replica] += 1
        result.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens += int(details.get("cached_tokens") or 0)
        result.ttft_ms.append(((first or time.perf_counter()) - started) * 1000)
        history.append({"role": "assistant", "content": "".join(content) or "ok"})


@contextlib.contextmanager
def replicas_for(backend: str, count: int, slots: int) -> Iterator[list[tuple[str, str]]]:
    """(url, engine) of `count` fresh replicas of the backend, stopped afterwards."""
    with contextlib.ExitStack() as stack:
        if backend == "sim":
            from bench.support.servers import ThreadServer
            from gateway.simulator import SimConfig, create_app

            servers = []
            for i in range(count):
                config = SimConfig(
                    engine="vllm", model="bench", seed=i, slots=slots, time_scale=0.05, prefill_tps=20000
                )
                server = ThreadServer(create_app(config)).start()
                stack.callback(server.stop)
                servers.append((server.url, "vllm"))
            yield servers
        elif backend == "llama":
            from bench.support.engines import LlamaServer, ensure_gguf

            model = ensure_gguf()
            yield [
                # Each slot gets the model's full training context (16k tokens).
                (
                    stack.enter_context(
                        LlamaServer(model, slots=slots, ctx=16384 * slots, name=f"bench{i}")
                    ).url,
                    "llamacpp",
                )
                for i in range(count)
            ]
        else:
            from bench.support.engines import VllmServer, ensure_hf_model

            model = ensure_hf_model()
            yield [
                (stack.enter_context(VllmServer(model, "bench", cpu=i % 2, max_model_len=4096)).url, "vllm")
                for i in range(count)
            ]


def routes(replicas: list[tuple[str, str]], scenario: Scenario) -> str:
    listing = ", ".join(
        f'{{name: r{i}, url: "{url}", engine: {engine}}}' for i, (url, engine) in enumerate(replicas)
    )
    return f"""
defaults: {{min_max_tokens: 0, thinking: true}}
presets:
  bench:
    served_model: bench
    policy: {scenario.policy}
    prefix: {{volatile: {scenario.volatile}}}
    replicas: [{listing}]
routing: {{default: bench}}
"""


async def drive(
    url: str, scenario: Scenario, result: Result, conversations: int, turns: int, words: int
) -> None:
    # Below llama-server's 5 s keep-alive, so a direct run does not lose requests to the keep-alive race.
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    async with httpx2.AsyncClient(timeout=300, limits=limits, trust_env=False) as http:
        await asyncio.gather(
            *(converse(http, url, "bench", i, turns, scenario, result, words) for i in range(conversations))
        )


def run_scenario(
    scenario: Scenario, backend: str, *, conversations: int, turns: int, replicas: int, slots: int, words: int
) -> dict[str, Any]:
    from bench.support.gateway import run_gateway

    count = 1 if scenario.target == "direct" else replicas
    result = Result(scenario.name, backend, conversations, turns, count)
    # Fresh replicas per scenario: no scenario inherits another's warm cache.
    with replicas_for(backend, count, slots) as fleet:
        if scenario.target == "direct":
            asyncio.run(
                drive(fleet[0][0] + "/v1/chat/completions", scenario, result, conversations, turns, words)
            )
        else:
            with run_gateway(routes(fleet, scenario), log_requests=False) as gateway:
                asyncio.run(
                    drive(gateway.url + "/v1/chat/completions", scenario, result, conversations, turns, words)
                )
    return result.summary()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backend", choices=("sim", "llama", "vllm"), default="sim")
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--replicas", type=int)
    parser.add_argument("--slots", type=int, help="sequence slots per replica (llama-server -np)")
    parser.add_argument("--words", type=int, help="system prompt length in words (sim 600, engines 300)")
    parser.add_argument("--quick", action="store_true", help="a few conversations: under a minute")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "prefix.jsonl")
    args = parser.parse_args()
    large = args.backend == "sim" and not args.quick
    conversations = args.conversations or (4 if args.quick else 100 if large else 10)
    turns = args.turns or (3 if args.quick else 6)
    replicas = args.replicas or (8 if large else 2)
    slots = args.slots or (16 if large else 5)
    words = args.words or (600 if args.backend == "sim" else 300)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shape = f"{conversations} conversations x {turns} turns, {replicas} replicas, {slots} slots each"
    print(f"backend {args.backend}: {shape}")
    header = (
        f"{'scenario':46} {'hit':>6} {'prefilled':>10} {'ttft p50':>9} {'p95':>8} {'max share':>9} {'err':>4}"
    )
    print(header)
    with args.out.open("a") as out:
        for scenario in SCENARIOS:
            row = run_scenario(
                scenario,
                args.backend,
                conversations=conversations,
                turns=turns,
                replicas=replicas,
                slots=slots,
                words=words,
            )
            row["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            out.write(json.dumps(row) + "\n")
            share, p50, p95 = row["max_replica_share"] or 1, row["ttft_p50_ms"] or 0, row["ttft_p95_ms"] or 0
            figures = (
                f"{row['hit_ratio']:6.3f} {row['prefilled_tokens']:10d} {p50:9.1f} {p95:8.1f} {share:9.2f}"
            )
            print(f"{scenario.name:46} {figures} {row['errors']:4d}", flush=True)


if __name__ == "__main__":
    main()
