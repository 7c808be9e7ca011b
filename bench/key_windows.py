"""What a named key's limits cost each of its requests, fresh and after a busy day, against other
revisions.

    python -m bench.key_windows [--against REV ...] [--rounds N] [--requests N] [--out FILE]

`bench.gateway --with-team` runs a key with every limit for a few seconds: its token windows hold a
handful of buckets. A key that has been busy all day holds 1,440 one-minute buckets in its day
window, and whatever the counters do per bucket they do on each of its requests. This runs the
counters of one process (gateway/team/windows.py) over a fake clock: a request's admission (its
limits checked, its tokens reserved) and its charge, first on a fresh key, then on a key that sent
a request every minute for 24 hours. Each contender is this checkout or a revision built by
bench/proxycost/revisions.py (`--against`), in a process of its own pinned to core 0, alternated
round by round; the result is the median CPU time per request and each revision's ratio.

Results: a table on stdout and JSON lines appended to bench/results/key_windows.jsonl (or --out).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench.proxycost.host import terminate_cleanly
from bench.proxycost.side_by_side import arguments, contenders, race, report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "key_windows.jsonl"
UNSERVED = 3  # the child's exit status for a revision without the team's counters
CASES = ("fresh key", "key busy for a day")

# Run in the contender's own interpreter: it imports only that revision's `gateway`.
CHILD = r"""
import asyncio, json, sys, time
case, n, unserved = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    from gateway.team.limits import KeyLimits, Usage
    from gateway.team.windows import LocalCounters
except ImportError:  # a revision from before the team
    raise SystemExit(unserved)

now = 1_800_000_000.0
counters = LocalCounters(lambda: now)
limits = KeyLimits(concurrent=64, requests_per_minute=10**9, tokens_per_minute=10**12, tokens_per_day=10**15)

async def one():
    admission = await counters.admit("bench", limits, "bench", 7500)
    counters.charge_now("bench", "bench", Usage(7400, 7000, 300, 0), admission.reservation)

async def run():
    global now
    if case == "day":
        for _ in range(1440):  # a request every minute for a day: every day bucket holds tokens
            now += 60.0
            await one()
    start = time.process_time()
    for _ in range(n):
        now += 0.001
        await one()
    print(json.dumps({"us": (time.process_time() - start) / n * 1e6}))

asyncio.run(run())
"""


def measure(python: str, case: str, requests: int) -> float | None:
    """CPU microseconds per request, or None for a revision without the counters."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["PYTHONPATH"] = ""  # the contender's own package, not this checkout's
    out = subprocess.run(
        ["taskset", "-c", "0", python, "-c", CHILD, case, str(requests), str(UNSERVED)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd="/",
        check=False,
    )
    if out.returncode == UNSERVED:
        return None
    if out.returncode != 0:
        raise SystemExit(f"{python} ({case}): {out.stderr.strip()[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["us"])


def main() -> None:
    args = arguments(__doc__, requests=5000, out=RESULTS).parse_args()
    racers = contenders(args.against, args.compiled)
    rows = []
    for label, case in zip(CASES, ("fresh", "day"), strict=True):

        def one(python: str, case: str = case) -> float | None:
            return measure(python, case, args.requests)

        medians, samples = race(racers, args.rounds, one)
        rows.append((label, medians, samples))
    report(
        rows,
        [name for name, _ in racers],
        title=f"CPU per request of a key's admission and charge, median of {args.rounds} rounds"
        " (lower is better)",
        column="key",
        unit=" us",
        decimals=1,
        figure="cpu_us",
        out=args.out,
    )


if __name__ == "__main__":
    with terminate_cleanly():  # a child measuring when SIGTERM comes is killed by subprocess.run
        main()
