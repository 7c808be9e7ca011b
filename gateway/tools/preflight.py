"""`fleet-gateway check --probe`: before going live, ask every replica what it really is.

Reachable, healthy (`/health` 200), serving the model name the table expects (`/v1/models`; vLLM
answers 404 to any other name), and with what context length. A table on stdout; any problem
makes the command exit non-zero.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import orjson

from gateway.fleet.prober import parse_models
from gateway.routing.table import Preset, ReplicaSpec, Table
from gateway.upstream import UpstreamClient, UpstreamError, create_client


@dataclass(frozen=True)
class Finding:
    """What probing one replica found: whether it was reachable, its `/health` status, the models
    and context it serves, and the problem, if any, that should stop the table going live."""

    preset: str
    replica: str
    engine: str
    reachable: bool
    health: str
    served: tuple[str, ...]
    context: int | None
    problem: str | None


async def probe_replica(client: UpstreamClient, preset: Preset, spec: ReplicaSpec, timeout: float) -> Finding:
    """Asks one replica for `/health` and `/v1/models` with its key: a problem when it is
    unreachable, not answering 200, or (vLLM) not serving the preset's model name. Never raises for
    the replica's failures."""
    key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
    headers = [("authorization", f"Bearer {key}")] if key else []

    def finding(
        reachable: bool, health: str, served: tuple[str, ...], context: int | None, problem: str | None
    ) -> Finding:
        return Finding(preset.name, spec.name, spec.engine, reachable, health, served, context, problem)

    try:
        status, _ = await client.get(spec.url + "/health", headers, timeout)
    except UpstreamError as exc:
        return finding(False, "-", (), None, f"unreachable ({exc.kind})")
    health = str(status)
    try:
        models_status, body = await client.get(spec.url + "/v1/models", headers, timeout)
        served, context = parse_models(orjson.loads(body)) if models_status == 200 else ((), None)
    except (UpstreamError, orjson.JSONDecodeError):
        served, context = (), None
    problem = None
    if status != 200:
        problem = "not ready: /health answered " + health + (" (still loading?)" if status == 503 else "")
    elif spec.engine == "vllm" and preset.served_model not in served:
        problem = (
            f"serves {', '.join(served) or 'nothing'}, not {preset.served_model} (vLLM would answer 404)"
        )
    return finding(True, health, served, context, problem)


async def probe_table(
    table: Table, timeout: float = 5.0, client: UpstreamClient | None = None
) -> list[Finding]:
    own = client is None
    client = client or create_client()
    try:
        work = [
            probe_replica(client, preset, spec, timeout)
            for preset in table.presets.values()
            for spec in preset.replicas
        ]
        return list(await asyncio.gather(*work))
    finally:
        if own:
            await client.aclose()


def render(findings: list[Finding]) -> str:
    """The findings as an aligned table, one row per replica, ending in OK or the problem."""
    rows = [("preset", "replica", "engine", "health", "serves", "context", "status")]
    for f in findings:
        rows.append(
            (
                f.preset,
                f.replica,
                f.engine,
                f.health if f.reachable else "unreachable",
                ",".join(f.served) or "-",
                str(f.context or "-"),
                "OK" if f.problem is None else f"PROBLEM: {f.problem}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:6])) + "  " + row[6] for row in rows
    )
