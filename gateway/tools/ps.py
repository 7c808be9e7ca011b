"""`fleet-gateway ps`: one line per launched replica of a running gateway (GET /admin/replicas)."""

from __future__ import annotations

import sys
from typing import Any

import httpx2

COLUMNS = ("NAME", "STATE", "SINCE", "USES", "IN FLIGHT", "IDLE", "LAST LOAD", "LOADS", "REASON")


def rows(replicas: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for r in replicas:
        uses = ",".join(f"{device}:{gib:g}" for device, gib in r["uses"].items()) or "-"
        idle = "-" if r["idle_s"] is None else f"{r['idle_s']:.0f}s"
        load = "-" if r["last_load_s"] is None else f"{r['last_load_s']:.1f}s"
        out.append(
            (
                r["name"],
                r["state"],
                f"{r['since_s']:.0f}s",
                uses,
                str(r["in_flight"]),
                idle,
                load,
                str(r["loads"]),
                r["reason"],
            )
        )
    return out


def render(replicas: list[dict[str, Any]]) -> str:
    table: list[tuple[str, ...]] = [COLUMNS, *rows(replicas)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in table
    ]
    return "\n".join(line.rstrip() for line in lines)


def ps_command(url: str, key: str | None) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx2.get(url.rstrip("/") + "/admin/replicas", headers=headers, timeout=10)
    except httpx2.HTTPError as exc:
        print(f"fleet-gateway ps: cannot reach {url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"fleet-gateway ps: {url} answered {response.status_code}", file=sys.stderr)
        return 1
    replicas = response.json()["replicas"]
    print(
        render(replicas) if replicas else "no launched replicas (none of the table's replicas has `launch`)"
    )
    for replica in replicas:
        if replica["state"] == "failed" and replica["log_tail"]:
            print(f"\n{replica['name']}: last log lines\n{replica['log_tail']}")
    return 0
