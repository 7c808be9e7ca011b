"""The gateway's own cost, against an upstream that costs nothing: `python -m bench.gateway`.

    python -m bench.gateway [--quick] [--rounds N] [--duration S] [--out FILE] [--no-nginx]
                            [--minimal | --no-minimal] [--profile [GATEWAY]]
                            [--against REV ...] [--compiled REV ...] [--with-team] [--rev-cache DIR]

Up to four contenders (more with `--against` and `--with-team`, below), side by side in one run:
the instant upstream reached directly (`direct`), through the gateway (`gateway`: `fleet-gateway
serve` with the shipped routes.yaml's defaults, access log on), through the minimal Python proxy
the performance targets were set against (`minimal`: on in full runs, `--minimal` in quick ones; it
tells how fast this host is) and, when it is installed, through nginx as a plain keep-alive reverse
proxy (`nginx`, a reference for what a proxy hop costs). The
proxies run pinned to core 0; the upstream, wrk and the Python clients to core 1. Contenders
alternate within each round (direct, gateway, minimal, nginx, direct, ...) so that drift of a
shared, noisy machine spreads over all of them; the result is the median.

`--against REV` (repeatable) adds another revision of the gateway as a contender (`gateway@<commit>`):
that commit pip-installed into a scratch environment kept by commit (bench/proxycost/revisions.py),
started with what its own `fleet-gateway serve` accepts, the same routes table, pinned and
alternated like the others. `--compiled REV` (repeatable) adds a revision built as the Docker image
ships it, its request path compiled with mypyc (`gateway@<commit>+mypyc`; the build takes several
minutes, once per commit). `--with-team` adds this checkout's gateway with a named key and every
limit configured, counted in the process (`gateway+team`; its clients send the key). With any of them,
a second table gives five figures of the gateway's own cost per contender and the ratios between
gateways (this checkout over each revision; with a team over without), also recorded as
`<metric>_ratio` lines.

Measurements: latency at 1 client (wrk), requests/s at 64 clients (wrk), streams/s at 32 clients
with 64 SSE chunks each (wrk), time to first token at 1 client (a raw asyncio client), gateway RSS
idle / with many open streams / growth per 1,000 requests, the time of a 16k-token and of 32 MiB
and 8 MiB request bodies, and the gateway's event-loop lag meanwhile (a /health probe every 10 ms).

Results: a table on stdout and JSON lines appended to bench/results/gateway.jsonl (or --out).
`--quick` (three rounds of 1 s runs, 200 open streams) takes about a minute; CI runs it
(tests/bench/test_bench.py) and checks what it reports, never how fast: no figure is compared with a bound.
Run from the repository root (`python -m` puts it on the import path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from bench.proxycost.constants import DEFAULT_OUT
from bench.proxycost.host import (
    CORES,
    PINNED,
    BenchError,
    Noise,
    raise_nofile,
    run_fields,
    terminate_cleanly,
)
from bench.proxycost.loadgen import run_child
from bench.proxycost.report import (
    Recorder,
    comparison,
    record_ratios,
    scale_targets,
    scaled_summary,
    table,
)
from bench.proxycost.revisions import build_all, default_cache
from bench.proxycost.run import Bench, Plan


def plan_for(args: argparse.Namespace) -> Plan:
    if args.quick:
        plan = Plan(
            quick=True,
            # Three short rounds rather than one long one: a second that the hypervisor steals
            # from one contender spoils one round, and the median of three sets it aside.
            rounds=3,
            duration=1,
            ttft_requests=100,
            streams=200,
            growth_warmup=1000,
            body_small=30,
            body_big=5,  # the per-body worst stall is a median over the big bodies: it needs a few
            probe_baseline=1.0,
        )
    else:
        plan = Plan(
            quick=False,
            rounds=3,
            duration=5,
            ttft_requests=1000,
            streams=1000,
            growth_warmup=5000,
            body_small=200,
            body_big=5,
            probe_baseline=3.0,
        )
    if args.rounds:
        plan.rounds = args.rounds
    if args.duration:
        plan.duration = args.duration
    return plan


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="three rounds of 1 s runs, 200 streams: about a minute"
    )
    parser.add_argument("--rounds", type=int, help="rounds of the alternating tests (default 3, quick 3)")
    parser.add_argument("--duration", type=int, help="seconds per wrk run (default 5, quick 1)")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON lines, appended (default {DEFAULT_OUT})"
    )
    parser.add_argument("--no-nginx", action="store_true", help="leave out the nginx reference")
    parser.add_argument(
        "--minimal",
        action=argparse.BooleanOptionalAction,
        help="run the minimal Python proxy beside the gateway (default: on, off with --quick)",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="gateway",
        metavar="GATEWAY",
        help="py-spy a gateway (default this checkout's; or gateway+team, or an --against revision) in an"
        " extra rps_64 run: a summary on stdout, speedscope and collapsed stacks beside --out",
    )
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="REV",
        help="also run that revision of the gateway (any git revision; repeatable); built once per commit",
    )
    parser.add_argument(
        "--compiled",
        action="append",
        default=[],
        metavar="REV",
        help="also run that revision with its request path compiled by mypyc, as the image ships it"
        " (repeatable); built once per commit, in minutes",
    )
    parser.add_argument(
        "--with-team",
        action="store_true",
        help="also run this checkout's gateway with a named key and limits (in-process counters)",
    )
    parser.add_argument(
        "--rev-cache",
        type=Path,
        default=None,
        help=f"where --against environments are kept (default {default_cache()})",
    )
    parser.add_argument("--child", nargs=2, metavar=("KIND", "PARAMS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child[0], json.loads(args.child[1]))
        return 0
    if shutil.which("wrk") is None:
        print(
            "bench.gateway needs wrk: apt-get install wrk (scripts/install-system installs it)",
            file=sys.stderr,
        )
        return 2
    plan = plan_for(args)
    nproc = len(os.sched_getaffinity(0))
    if PINNED:
        os.sched_setaffinity(0, {CORES[1]})  # this process and what it starts unpinned: the clients' core
    else:
        print("warning: no taskset or a single core: nothing is pinned", file=sys.stderr)
    raise_nofile()  # inherited by the gateway, nginx and the clients: 1,000 streams are 2,000+ sockets
    recorder = Recorder(
        {
            **run_fields("gateway", nproc, plan.quick),
            "rounds": plan.rounds,
            "duration_s": plan.duration,
        }
    )
    use_minimal = not plan.quick if args.minimal is None else args.minimal
    began = time.monotonic()
    with terminate_cleanly():
        try:
            cache = args.rev_cache or default_cache()
            revisions = build_all(args.against, cache) + build_all(args.compiled, cache, compiled=True)
        except BenchError as exc:
            print(f"bench.gateway: {exc}", file=sys.stderr)
            return 1
    for revision in revisions:
        deps = "this environment's dependencies" if revision.layered else "its own dependencies"
        print(f"{revision.name}: {revision.rev} in {revision.env}, on {deps}", file=sys.stderr, flush=True)
    bench = Bench(
        plan,
        use_nginx=not args.no_nginx,
        use_minimal=use_minimal,
        profile=args.profile,
        recorder=recorder,
        with_team=args.with_team,
        revisions=revisions,
        profile_dir=args.out.parent,
    )
    load = Noise()
    with terminate_cleanly():
        try:
            bench.start()
            print(f"contenders: {', '.join(c.name for c in bench.contenders)}", file=sys.stderr, flush=True)
            bench.warm_up()
            bench.check_streams()
            bench.rounds()
            print("memory", file=sys.stderr, flush=True)
            bench.memory()
            print("bodies", file=sys.stderr, flush=True)
            bench.bodies()
            if args.profile is not None:
                bench.profile_gateway()
        except BenchError as exc:
            print(f"bench.gateway: {exc}", file=sys.stderr)
            return 1
        finally:
            bench.close()
    scale_targets(recorder)
    names = [c.name for c in bench.contenders]
    record_ratios(recorder, names)
    wall = time.monotonic() - began
    noise = load.report()
    for line in recorder.lines:
        line["wall_s"] = round(wall, 1)
        line["noise"] = noise
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for line in recorder.lines:
            out.write(json.dumps(line) + "\n")
    print()
    print(table(recorder, names))
    summary = scaled_summary(recorder)
    if summary:
        print("\n" + summary)
    compared = comparison(recorder, names)
    if compared:
        print("\n" + compared)
    commit = f"{recorder.common['commit']}" + ("+dirty" if recorder.common["dirty"] else "")
    print(
        f"\n{recorder.common['date']}  {platform.machine()}, {nproc} cores  commit {commit}"
        f"  {recorder.common['mode']}: {plan.rounds} round(s) x {plan.duration} s, {plan.streams} streams"
        f"  wall {wall:.0f} s  -> {args.out}"
    )
    print(
        f"other load on the machine meanwhile: {noise['foreign_cpu_s']} CPU-s"
        f" ({noise['foreign_cores']:.2f} of a core on average), VM steal {noise['steal_s']} s"
    )
    if noise["foreign_cores"] > 0.1:
        print("warning: the machine was not quiet; rerun for numbers to compare", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
