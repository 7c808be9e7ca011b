"""`fleet_status`: one entry per preset, what an orchestrator needs to decide where work goes (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.fleet.replicas import Fleet
from gateway.ops import catalogue


def fleet_status(fleet: Fleet, speeds: Mapping[str, float | None]) -> dict[str, Any]:
    table = fleet.table
    tasks_of: dict[str, list[str]] = {}
    for task, target in table.tasks.items():
        tasks_of.setdefault(target, []).append(task)
    presets = [
        {
            **catalogue.preset_view(fleet, pool),
            "tasks": sorted(tasks_of.get(name, [])),
            "decode_tokens_per_second": speeds.get(name),
        }
        for name, pool in fleet.pools.items()
    ]
    return {"presets": presets, "default": table.default, "images": table.images}
