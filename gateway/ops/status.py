"""The status page's data: the fleet as it is now, and the last few minutes of traffic.

`/ui/state` returns this as JSON; `/ui` is a static page (gateway/ui/) that polls it. Names,
numbers and states only: no URLs, keys or prompt text.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from gateway import __version__
from gateway.fleet.replicas import Fleet, Replica
from gateway.ops import catalogue
from gateway.ops.recent import Recent, Sample, summarise


def state(
    fleet: Fleet,
    recent: Recent,
    started: float,
    wall: float | None = None,
    launched: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`launched`: the supervisor's view of the replicas the gateway starts and stops."""
    lifecycle = {entry["name"]: entry for entry in launched or ()}
    now = fleet.clock()
    samples = recent.window()
    by_preset: dict[str, list[Sample]] = defaultdict(list)
    by_replica: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_preset[sample.preset].append(sample)
        if sample.replica:
            by_replica[sample.replica].append(sample)
    presets = []
    for name, pool in fleet.pools.items():
        preset = pool.preset
        presets.append(
            {
                **catalogue.preset_view(fleet, pool),
                "policy": preset.policy,
                "thinking": preset.thinking,
                "vision": preset.vision,
                "panic": pool.panic(),
                **summarise(by_preset.get(name, []), now=now),
                "replicas": [
                    _replica(r, now, by_replica.get(r.name, []), lifecycle.get(r.name)) for r in pool.replicas
                ],
            }
        )
    return {
        "version": __version__,
        "time": round(wall if wall is not None else time.time(), 3),
        "uptime_s": round(now - started, 1),
        "window_s": 300,
        "totals": {**summarise(samples, now=now), "requests_since_start": recent.total},
        "presets": presets,
        "unrouted": summarise(by_preset.get("unknown", []), now=now)["requests"],
        "warnings": [
            {
                "time": round(w.at, 3),
                "kind": w.kind,
                "preset": w.preset,
                "replica": w.replica,
                "message": w.message,
            }
            for w in reversed(recent.warnings)
        ],
    }


def _replica(
    replica: Replica, now: float, samples: list[Sample], lifecycle: dict[str, Any] | None = None
) -> dict[str, Any]:
    health = replica.health
    status = "ejected" if health.ejected(now) else health.status.value
    figures = summarise(samples, now=now)
    return {
        "name": replica.name,
        "engine": replica.engine,
        "state": status,
        "in_flight": replica.in_flight,
        "max_in_flight": replica.limit,
        "context": replica.context,
        "probe_ms": None if replica.probe_latency is None else round(replica.probe_latency * 1000, 1),
        "backend": dict(replica.backend_metrics),
        # llama-server's slots and the agent session each holds (short digests only), and how many
        # more sessions the gateway believes sit in the replica's memory tier (fleet/slots.py).
        "slots": replica.cache.rows(now),
        "sessions_in_tier": replica.cache.tier(),
        # Launched replicas: stopped, starting, ready, stopping or failed, device use, a failed log.
        "lifecycle": lifecycle,
        **figures,
    }
