"""`fleet-gateway ps`: one line per launched replica of a running gateway (GET /admin/replicas), and
under each llama-server replica one line per slot: the agent session it holds (a short digest),
its tokens and how long ago it was used (fleet/slots.py)."""

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


def slot_lines(replica: dict[str, Any]) -> list[str]:
    """`  slot 0  session 3f2a9c1e  41250 tok  idle 12s`, or `free`, one per slot."""
    out: list[str] = []
    for slot in replica.get("slots") or []:
        if slot.get("session") is None:
            out.append(f"  slot {slot['slot']}  free")
            continue
        idle = "-" if slot.get("idle_s") is None else f"{slot['idle_s']:.0f}s"
        busy = "  busy" if slot.get("busy") else ""
        out.append(
            f"  slot {slot['slot']}  session {slot['session']}  {slot['tokens']} tok  idle {idle}{busy}"
        )
    saved = replica.get("saved_slots") or 0
    if saved:
        out.append(f"  {saved} slots saved, restored at the next start")
    return out


def render(replicas: list[dict[str, Any]]) -> str:
    table: list[tuple[str, ...]] = [COLUMNS, *rows(replicas)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]

    def line(row: tuple[str, ...]) -> str:
        text = "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        return text.rstrip()

    lines = [line(COLUMNS)]
    for replica, row in zip(replicas, table[1:], strict=True):
        lines.append(line(row))
        lines.extend(slot_lines(replica))
    return "\n".join(lines)


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
