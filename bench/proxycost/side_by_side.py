"""Contenders measured side by side, one process per measurement, for the in-process benchmarks
(bench.agent_body, bench.key_windows): this checkout and each `--against` revision, alternated
round by round, the median of each, and a table of the medians with this checkout's ratios."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from bench.proxycost.revisions import build_all, default_cache

T = TypeVar("T")

# One case's medians (None: a contender that cannot run it) and every round's figure, by contender.
Row = tuple[str, dict[str, float | None], dict[str, list[float]]]


def arguments(description: str | None, requests: int, out: Path) -> argparse.ArgumentParser:
    """The options every such benchmark takes: `--against`, `--compiled`, `--rounds`, `--requests`,
    `--out`."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", action="append", default=[], metavar="REV")
    parser.add_argument(
        "--compiled",
        action="append",
        default=[],
        metavar="REV",
        help="a revision with its request path compiled by mypyc, as the Docker image ships it",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=requests, help="per round and contender")
    parser.add_argument("--out", type=Path, default=out)
    return parser


def contenders(revs: list[str], compiled: list[str] | None = None) -> list[tuple[str, str]]:
    """(name, python) for this checkout, each revision and each compiled one."""
    found = [("gateway", sys.executable)]
    cache = default_cache()
    for revision in build_all(revs, cache) + build_all(compiled or [], cache, compiled=True):
        found.append((revision.name, str(revision.env / "bin" / "python")))
    return found


def race(
    racers: list[tuple[str, str]], rounds: int, measure: Callable[[str], float | None]
) -> tuple[dict[str, float | None], dict[str, list[float]]]:
    """`measure(python)` for each contender, alternated round by round: the medians and every
    round's figure. A contender measured None (it cannot run the case) leaves the race. Each round
    starts with the next contender (`in_turn`)."""
    samples: dict[str, list[float]] = {name: [] for name, _ in racers}
    running = list(racers)
    for turn in range(rounds):
        for name, python in in_turn(running, turn):
            figure = measure(python)
            if figure is None:
                running.remove((name, python))
            else:
                samples[name].append(figure)
    medians = {name: statistics.median(values) if values else None for name, values in samples.items()}
    return medians, samples


def in_turn(items: Sequence[T], turn: int) -> list[T]:
    """`items` from the one whose turn it is to go first: measured round by round this way, none is
    always measured first (just after a pause, or after another contender's process)."""
    if not items:
        return []
    start = turn % len(items)
    return [*items[start:], *items[:start]]


def report(
    rows: list[Row],
    names: list[str],
    *,
    title: str,
    column: str,
    unit: str,
    decimals: int,
    figure: str,
    out: Path,
) -> None:
    """The table on stdout (the medians, then this checkout over each revision) and one JSON line
    per case and contender appended to `out`: `{"at", column, "contender", figure, "rounds"}`."""
    print(title)
    print(f"| {column} | " + " | ".join(names) + "".join(f" | gw / {n[8:]}" for n in names[1:]) + " |")
    print("|---" * (len(names) * 2) + "|")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as lines:
        for label, medians, samples in rows:
            ours = medians["gateway"]
            ratios = [_ratio(ours, medians[n]) for n in names[1:]]
            cells = " | ".join(
                "n/a" if medians[n] is None else f"{medians[n]:,.{decimals}f}{unit}" for n in names
            )
            print(f"| {label} | {cells}" + "".join(f" | {r}" for r in ratios) + " |")
            for name in names:
                line: dict[str, Any] = {"at": stamp, column: label, "contender": name, figure: medians[name]}
                lines.write(json.dumps({**line, "rounds": samples[name]}) + "\n")


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or theirs is None else f"{ours / theirs:.2f}x"
