"""`fleet_status`: one entry per preset, what an orchestrator needs to decide where work goes (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.fleet.replicas import Fleet, Pool
from gateway.ops import catalogue


def loaded(pool: Pool) -> bool:
    """A replica of the preset is ready to answer now (no load to wait for)."""
    return pool.ready()


def fleet_status(fleet: Fleet, speeds: Mapping[str, float | None]) -> dict[str, Any]:
    table = fleet.table
    tasks_of: dict[str, list[str]] = {}
    for task, target in table.tasks.items():
        tasks_of.setdefault(target, []).append(task)
    presets = []
    for name, pool in fleet.pools.items():
        preset = pool.preset
        presets.append(
            {
                "name": name,
                "served_model": preset.served_model,
                "aliases": list(preset.aliases),
                "tasks": sorted(tasks_of.get(name, [])),
                "capabilities": catalogue.capabilities(preset),
                "context_length": catalogue.context_length(fleet, preset),
                "loaded": loaded(pool),
                "queue": pool.queued,
                "in_flight": sum(r.in_flight for r in pool.replicas),
                "decode_tokens_per_second": speeds.get(name),
            }
        )
    return {"presets": presets, "default": table.default, "images": table.images}
