"""`fleet-gateway demo`: the example fleet of routes.yaml, on simulated replicas, in one process.

For a newcomer with no GPU: routing, rewriting, streaming, the prefix cache and the thinking
trap all behave as they would in front of real vLLM and llama.cpp replicas, at simulated speeds.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from gateway.app import build_gateway, create_app
from gateway.routing.table import Table, parse_table
from gateway.settings import Settings
from gateway.simulator import SimConfig, SimServer, serve_sim

log = logging.getLogger("gateway.tools.demo")


@dataclass(frozen=True)
class DemoReplica:
    """One simulated replica of the demo fleet: its name, engine, served model, decode speed,
    whether its template thinks by default, and its slots."""

    name: str
    engine: str
    model: str
    decode_tps: float
    thinking: bool = True  # what the simulated template does without chat_template_kwargs
    slots: int = 4


# The shipped routes.yaml fleet, shrunk to what a laptop simulates comfortably.
REPLICAS = {
    "dense": [
        DemoReplica("gpu0-dense", "vllm", "Qwen3.6-27B-AWQ", decode_tps=40),
        DemoReplica("gpu1-dense", "vllm", "Qwen3.6-27B-AWQ", decode_tps=40),
    ],
    "moe": [DemoReplica("gpu0-moe", "vllm", "Qwen3.6-35B-A3B-AWQ", decode_tps=90)],
    "vision": [DemoReplica("gpu0-vision", "vllm", "Qwen3-VL-8B-Instruct", decode_tps=70, thinking=False)],
    "small": [DemoReplica("gpu1-small", "vllm", "Qwen3-4B-Instruct", decode_tps=150, thinking=False)],
    "swift": [DemoReplica("gpu1-swift", "llamacpp", "swift-qwen3.8-27b", decode_tps=30, slots=2)],
}

DEMO_TABLE = """
defaults:
  thinking: false
  max_tokens: 8192
  min_max_tokens: 1024
  policy: round_robin
  prefix: {{volatile: warn}}
health: {{interval: 2, timeout: 1}}
presets:
  dense:
    served_model: Qwen3.6-27B-AWQ
    aliases: [qwen3.6-27b, coder, "claude-*opus*", "claude-*sonnet*", "gpt-5*codex*"]
    max_tokens: 32768
    params: {{temperature: 0.6}}
    policy: prefix_affinity
    prefix: {{volatile: move}}
    replicas: {dense}
  moe:
    served_model: Qwen3.6-35B-A3B-AWQ
    aliases: [qwen3.6-moe, bulk, "claude-*haiku*", "gpt-*"]
    replicas: {moe}
  vision:
    served_model: Qwen3-VL-8B-Instruct
    aliases: [vl]
    vision: true
    replicas: {vision}
  small:
    served_model: Qwen3-4B-Instruct
    aliases: [extract]
    max_tokens: 4096
    params: {{temperature: 0}}
    replicas: {small}
  swift:
    served_model: swift-qwen3.8-27b
    thinking: true
    max_tokens: 32768
    min_max_tokens: 4096
    timeouts: {{read: 7200}}
    replicas: {swift}
tasks: {{bulk: moe, code: dense, reasoning: swift, extract: small, vision: vision}}
routing: {{default: moe, images: vision}}
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def demo_table(ports: dict[str, int]) -> Table:
    listing = {
        preset: "["
        + ", ".join(
            f'{{name: {r.name}, url: "http://127.0.0.1:{ports[r.name]}", engine: {r.engine}}}'
            for r in replicas
        )
        + "]"
        for preset, replicas in REPLICAS.items()
    }
    return parse_table(DEMO_TABLE.format(**listing), "<demo fleet>")


async def start_replicas(ports: dict[str, int]) -> list[SimServer]:
    servers = []
    for seed, replica in enumerate(r for group in REPLICAS.values() for r in group):
        config = SimConfig(
            engine=replica.engine,  # type: ignore[arg-type]
            model=replica.model,
            seed=seed,
            slots=replica.slots,
            decode_tps=replica.decode_tps,
            prefill_tps=4000,
            thinking_default=replica.thinking,
            reasoning_tokens=120,
        )
        servers.append(await serve_sim(config, ports[replica.name]))
    return servers


def banner(url: str) -> str:
    """The text printed when the demo starts: where it listens, example requests by model and by
    task, the OpenAI client setting, and the models, metrics and ready URLs."""
    return "\n".join(
        [
            f"Fleet Gateway demo on {url}: the example fleet on 6 simulated replicas (no GPU needed).",
            "",
            "  Try it:",
            f"    curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\",
            """      -d '{"model": "coder", "messages": [{"role": "user", "content": "Say hello"}]}'""",
            "",
            "  Streaming, by task instead of model:",
            f"    curl -sN {url}/v1/chat/completions -H 'x-task: bulk' \\",
            "      -H 'content-type: application/json' \\",
            """      -d '{"messages": [{"role": "user", "content": "Say hello"}], "stream": true}'""",
            "",
            f"  OpenAI client: OpenAI(base_url='{url}/v1', api_key='unused')",
            f"  Models: {url}/v1/models   Metrics: {url}/metrics   Ready: {url}/ready",
            "  Ctrl-C stops it.",
        ]
    )


async def serve_demo(settings: Settings) -> None:
    from gateway.server import run

    ports = {r.name: _free_port() for group in REPLICAS.values() for r in group}
    replicas = await start_replicas(ports)
    try:
        gateway = build_gateway(settings, demo_table(ports))
        await run(gateway, create_app(gateway), banner(f"http://{settings.host}:{settings.port}"))
    finally:
        for replica in replicas:
            await replica.stop()


def run_demo(settings: Settings) -> int:
    from gateway.server import run_loop

    run_loop(serve_demo(settings))
    return 0
