"""The measurement phases of a run, each over every contender: warm-up, the streams' check, the
alternating rounds (latency, requests/s, streams/s, time to first token), memory, big bodies with the
/health probe meanwhile, and the optional profile."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.proxycost.bodies import HOLD_BODY, STREAM_BODY
from bench.proxycost.constants import CHAT, CHUNKS, DEFAULT_OUT
from bench.proxycost.contenders import Contender, Lineup
from bench.proxycost.host import BenchError, CoreWatch, pin, rss_mb
from bench.proxycost.loadgen import call_child, child_argv, read_line
from bench.proxycost.report import Recorder, percentile, summarise_profile, to_speedscope
from bench.proxycost.revisions import Revision
from bench.proxycost.side_by_side import in_turn
from bench.proxycost.wrk import WrkResult, run_wrk


@dataclass
class Plan:
    """How much each phase runs: set from the command line by `plan_for` in bench.gateway."""

    quick: bool
    rounds: int
    duration: int
    ttft_requests: int
    streams: int
    growth_warmup: int
    body_small: int
    body_big: int
    probe_baseline: float


class Bench(Lineup):
    """The lineup, measured: each phase runs over every contender and records into `rec`."""

    def __init__(
        self,
        plan: Plan,
        use_nginx: bool,
        use_minimal: bool,
        profile: str | None,
        recorder: Recorder,
        with_team: bool = False,
        revisions: Sequence[Revision] = (),
        profile_dir: Path = DEFAULT_OUT.parent,
    ) -> None:
        super().__init__(use_nginx, use_minimal, with_team, revisions)
        self.plan = plan
        self.profile = profile
        self.profiled: Contender | None = None
        self.profile_dir = profile_dir
        self.rec = recorder

    def start(self) -> None:
        super().start()
        self.rec.tags.update(self.tags)
        if self.profile is not None:
            self.profiled = self._profiled(self.profile)

    def _profiled(self, which: str) -> Contender:
        """The gateway contender `--profile` names: by its name, or a revision by what was given
        to --against or a prefix of its commit."""
        for contender in self.contenders:
            if contender.gateway and contender.name == which:
                return contender
        for revision in self.revisions:
            if which == revision.rev or (len(which) >= 4 and revision.commit.startswith(which)):
                return next(c for c in self.contenders if c.name == revision.name)
        names = ", ".join(c.name for c in self.contenders if c.gateway)
        raise BenchError(f"--profile {which}: not a gateway of this run ({names})")

    def warm_up(self) -> None:
        seconds = 1 if self.plan.quick else 2
        for contender in self.contenders:
            run_wrk(contender.url(), contender.scripts["small"], 64, seconds)
            run_wrk(contender.url(), contender.scripts["stream"], 32, 1)

    def check_streams(self) -> None:
        """Each contender's stream carries the 64 chunks and ends with [DONE], as curl sees it (the
        ttft client also counts the chunks of every stream it reads)."""
        curl = shutil.which("curl")
        for contender in self.contenders:
            if curl:
                argv = [curl, "-sSN", "--max-time", "10", "-H", "content-type: application/json"]
                for header, text in contender.headers.items():
                    argv += ["-H", f"{header}: {text}"]
                out = subprocess.run(
                    [*argv, "--data-binary", "@-", contender.url()],
                    input=STREAM_BODY,
                    capture_output=True,
                    timeout=20,
                    check=False,
                ).stdout
                chunks = out.count(b'"content":"tok"')
                done = out.rstrip().endswith(b"data: [DONE]")
            else:  # the ttft client, one stream
                params = {"port": contender.port, "path": CHAT, "body": STREAM_BODY.decode()}
                params["headers"] = contender.headers
                answer = call_child("ttft", {**params, "count": 1, "warmup": 0}, 30, contender.name)
                chunks, done = answer["chunks"][0], True
            self.rec.add(
                contender.name, "stream_chunks", chunks, "chunks", done=done, by="curl" if curl else "-"
            )
            if chunks != CHUNKS or not done:
                print(
                    f"warning: {contender.name}: a stream carried {chunks} chunks (done: {done})",
                    file=sys.stderr,
                )

    def rounds(self) -> None:
        plan = self.plan
        results: dict[tuple[str, str], list[WrkResult]] = {}
        ttft: dict[str, list[list[float]]] = {}
        for number in range(plan.rounds):
            print(f"round {number + 1}/{plan.rounds}", file=sys.stderr, flush=True)
            tests = (("latency_1", "small", 1), ("rps_64", "small", 64), ("streams_32", "stream", 32))
            order = in_turn(self.contenders, number)
            for test, script, connections in tests:
                for contender in order:
                    result = self._wrk(contender, script, connections)
                    results.setdefault((contender.name, test), []).append(result)
            for contender in order:
                params = {
                    "port": contender.port,
                    "path": CHAT,
                    "body": STREAM_BODY.decode(),
                    "count": plan.ttft_requests,
                    "warmup": 20,
                    "headers": contender.headers,
                }
                answer = call_child("ttft", params, 120, contender.name)
                ttft.setdefault(contender.name, []).append(answer["ttft_ms"])
                if answer["chunks"] != [CHUNKS]:
                    print(f"warning: {contender.name}: streams of {answer['chunks']} chunks", file=sys.stderr)
        self._record_rounds(results, ttft)

    def _wrk(self, contender: Contender, script: str, connections: int) -> WrkResult:
        """One wrk run, with the proxy's CPU time meanwhile (a figure that noise from other
        processes on the machine barely moves, unlike requests/s)."""
        watch = CoreWatch(contender.pid) if contender.pid else None
        result = run_wrk(contender.url(), contender.scripts[script], connections, self.plan.duration)
        if watch:
            result.cpu_s, result.others = watch.measure()
        return result

    def _record_rounds(
        self, results: dict[tuple[str, str], list[WrkResult]], ttft: dict[str, list[list[float]]]
    ) -> None:
        rec, med = self.rec, statistics.median
        for contender in self.contenders:
            name = contender.name
            latency = results[(name, "latency_1")]
            rec.add(
                name,
                "latency_1_p50",
                med(r.p50_ms for r in latency),
                "ms",
                rounds=[r.p50_ms for r in latency],
            )
            rec.add(
                name,
                "latency_1_p99",
                med(r.p99_ms for r in latency),
                "ms",
                rounds=[r.p99_ms for r in latency],
            )
            rec.add(
                name, "latency_1_rps", med(r.rps for r in latency), "req/s", rounds=[r.rps for r in latency]
            )
            for test in ("latency_1", "rps_64", "streams_32"):
                runs = results[(name, test)]
                if contender.pid:
                    cpu = [r.cpu_ms_per_request or 0.0 for r in runs]
                    core = [r.core or 0.0 for r in runs]
                    rec.add(name, f"{test}_cpu_ms", med(cpu), "ms", rounds=cpu)
                    rec.add(name, f"{test}_core", med(core), "cores", rounds=core)
                    others = [r.others for r in runs if r.others is not None]
                    if others:
                        rec.add(name, f"{test}_others", med(others), "cores", rounds=others)
            for test, unit in (("rps_64", "req/s"), ("streams_32", "streams/s")):
                runs = results[(name, test)]
                rec.add(
                    name,
                    test,
                    med(r.rps for r in runs),
                    unit,
                    rounds=[r.rps for r in runs],
                    p50_ms=med(r.p50_ms for r in runs),
                    p99_ms=med(r.p99_ms for r in runs),
                    requests=sum(r.requests for r in runs),
                )
                rec.add(
                    name,
                    f"{test}_errors",
                    sum(r.errors for r in runs),
                    "responses",
                    non_2xx=sum(r.non_2xx for r in runs),
                    socket_errors=sum(r.socket_errors for r in runs),
                )
            p50s = [percentile(s, 50) for s in ttft[name]]
            p99s = [percentile(s, 99) for s in ttft[name]]
            rec.add(name, "ttft_1_p50", med(p50s), "ms", rounds=p50s, requests=sum(map(len, ttft[name])))
            rec.add(name, "ttft_1_p99", med(p99s), "ms", rounds=p99s)
        direct = "direct"
        for contender in self.contenders[1:]:
            name = contender.name
            for metric, runs_of in (("latency_1_p50", "p50_ms"), ("latency_1_p99", "p99_ms")):
                pairs = zip(results[(name, "latency_1")], results[(direct, "latency_1")], strict=True)
                added = [getattr(a, runs_of) - getattr(b, runs_of) for a, b in pairs]
                rec.add(name, metric + "_added", med(added), "ms", rounds=added)
            for q in (50, 99):
                pairs_t = zip(ttft[name], ttft[direct], strict=True)
                added = [percentile(a, q) - percentile(b, q) for a, b in pairs_t]
                rec.add(name, f"ttft_1_p{q}_added", med(added), "ms", rounds=added)

    def memory(self) -> None:
        """RSS idle (after the rounds), growth per 1,000 requests, then with many open streams (last:
        the streams raise the heap's high-water mark, which would hide growth measured after them)."""
        plan = self.plan
        for contender in self.contenders:
            if contender.pid is None or contender.hold_path is None:
                continue
            pid, name = contender.pid, contender.name
            time.sleep(0.5)
            self.rec.add(name, "rss_idle_mb", rss_mb(pid), "MB")
            # Growth: RSS after a warm-up of N varied requests, then after 10 x N more.
            load = {"port": contender.port, "path": CHAT, "connections": 8, "headers": contender.headers}
            first = call_child("load", {**load, "count": plan.growth_warmup}, 300, name)
            time.sleep(0.5)
            before = rss_mb(pid)
            second = call_child("load", {**load, "count": 10 * plan.growth_warmup}, 600, name)
            time.sleep(0.5)
            after = rss_mb(pid)
            self.rec.add(
                name,
                "rss_growth_mb_per_1000",
                (after - before) / (second["requests"] / 1000),
                "MB",
                warmup_requests=first["requests"],
                requests=second["requests"],
                before_mb=round(before, 2),
                after_mb=round(after, 2),
                errors=first["errors"] + second["errors"],
                requests_per_s=round(second["requests"] / second["seconds"]),
            )
            # Open streams, each read up to its first event and then held open.
            params = {"port": contender.port, "path": contender.hold_path, "body": HOLD_BODY.decode()}
            params["count"] = plan.streams
            params["headers"] = contender.headers
            holder = self.procs.start(
                "streams", child_argv("hold", params), stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
            try:
                opened = read_line(holder, 120, f"opening {plan.streams} streams through {name}")
                time.sleep(0.5)
                with_streams = rss_mb(pid)
                assert holder.stdin is not None
                holder.stdin.write(b"close\n")
                holder.stdin.flush()
                holder.wait(timeout=30)
            finally:
                if holder.poll() is None:
                    holder.kill()
            if opened["opened"] != plan.streams:
                print(f"warning: {name}: {opened}", file=sys.stderr)
            time.sleep(1.0)
            self.rec.add(
                name,
                "rss_streams_mb",
                with_streams,
                "MB",
                streams=opened["opened"],
                failures=opened["failures"],
                per_stream_kb=round((with_streams - after) * 1000 / max(1, opened["opened"]), 1),
                after_close_mb=round(rss_mb(pid), 1),
            )
            self.rec.add(name, "streams_open", opened["opened"], "streams", wanted=plan.streams)

    def bodies(self) -> None:
        plan = self.plan
        params: dict[str, Any] = {"path": CHAT, "small": plan.body_small, "big": plan.body_big}
        results: dict[str, dict[str, Any]] = {}
        for contender in self.contenders:
            probe = None
            if contender.gateway:
                probe = self.procs.start(
                    "probe",
                    child_argv("probe", {"port": contender.port, "limit_s": 300}),
                    stdout=subprocess.PIPE,
                )
                read_line(probe, 15, "starting the /health probe")
                time.sleep(plan.probe_baseline)
            started = time.monotonic()
            watch = CoreWatch(contender.pid) if contender.pid else None
            try:
                results[contender.name] = call_child(
                    "bodies",
                    {**params, "port": contender.port, "headers": contender.headers},
                    300,
                    contender.name,
                )
            finally:
                if probe is not None:
                    probe.terminate()
            others = watch.measure()[1] if watch else None
            if others is not None:
                self.rec.add(contender.name, "bodies_others", others, "cores")
            if probe is not None:
                samples = read_line(probe, 15, "the /health probe's samples")["samples"]
                probe.wait(timeout=5)
                self._record_lag(contender.name, samples, started, results[contender.name]["windows"])
        rec, med = self.rec, statistics.median
        for name, result in results.items():
            for metric in ("body_16k_ms", "body_32m_ms", "body_4x8m_ms"):
                rec.add(
                    name,
                    metric.removesuffix("_ms"),
                    med(result[metric]),
                    "ms",
                    samples=len(result[metric]),
                    body_16k_bytes=result["bytes_16k"],
                )
            if name != "direct":
                for metric in ("body_16k_ms", "body_32m_ms", "body_4x8m_ms"):
                    added = med(result[metric]) - med(results["direct"][metric])
                    rec.add(name, metric.removesuffix("_ms") + "_added", added, "ms")

    def _record_lag(
        self, name: str, samples: list[list[float]], started: float, windows: dict[str, list[list[float]]]
    ) -> None:
        """The probe's latencies with no big body in flight (`lag_idle`), during the 32 MiB bodies,
        during the 4 x 8 MiB ones, and during either (`lag`)."""
        baseline = [latency for at, latency in samples if at < started]
        self.rec.add(name, "lag_idle_p50", percentile(baseline, 50), "ms", probes=len(baseline))
        self.rec.add(name, "lag_idle_p99", percentile(baseline, 99), "ms", probes=len(baseline))
        spans = {**windows, "": [w for ws in windows.values() for w in ws]}
        for kind, ranges in spans.items():
            each = [[latency for at, latency in samples if a <= at <= b] for a, b in ranges]
            during = [latency for window in each for latency in window]
            metric = f"lag_{kind}_" if kind else "lag_"
            self.rec.add(name, metric + "p50", percentile(during, 50), "ms", probes=len(during))
            worst = round(max(during), 2) if during else None
            self.rec.add(name, metric + "p99", percentile(during, 99), "ms", probes=len(during), max_ms=worst)
            if kind and each:
                # The worst probe during each big body, and their median: a stall that every body
                # causes (work on the event loop) shows in it, one that a single body met (the
                # hypervisor took the core, a collection ran) does not. A p99 over a few dozen
                # probes is their maximum, so one stolen 100 ms moves it alone.
                worst_each = [max(window, default=0.0) for window in each]
                self.rec.add(
                    name,
                    metric + "worst_median",
                    statistics.median(worst_each),
                    "ms",
                    bodies=len(worst_each),
                    each_ms=[round(v, 1) for v in worst_each],
                )

    def profile_gateway(self) -> None:
        """py-spy on one gateway (this checkout's unless `--profile` names another) during an extra
        rps_64 run (not counted): its busy time by function and module on stdout, the stacks in two
        files beside the JSON lines: collapsed stacks (`gateway-profile.txt`, for flamegraph.pl or
        speedscope) and a speedscope profile (`gateway-profile.speedscope.json`, for speedscope.app)."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        target = self.profiled
        if target is None or not Path(spy).exists():
            print("py-spy not found: no profile", file=sys.stderr)
            return
        seconds = max(self.plan.duration, 5)
        raw = self.tmp / "profile.txt"
        spy_argv = [*pin(1), spy, "record", "--nonblocking", "-r", "250", "-f", "raw", "-o", str(raw)]
        recorder = self.procs.start(
            "py-spy",
            [*spy_argv, "-d", str(seconds + 1), "-p", str(target.pid)],
            stdout=subprocess.DEVNULL,
            stderr=self._file("py-spy.err"),
        )
        time.sleep(0.5)
        result = run_wrk(target.url(), target.scripts["small"], 64, seconds)
        recorder.wait(timeout=60)
        if not raw.exists() or not raw.read_text().strip():
            error = (self.tmp / "py-spy.err").read_text().strip()[-1000:]
            print(f"py-spy recorded nothing (status {recorder.returncode}): {error}", file=sys.stderr)
            return
        text = raw.read_text()
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        collapsed = self.profile_dir / "gateway-profile.txt"
        speedscope = self.profile_dir / "gateway-profile.speedscope.json"
        collapsed.write_text(text)
        speedscope.write_text(json.dumps(to_speedscope(text, f"{target.name}, rps_64 under py-spy")))
        print(f"\nprofile of {target.name} during rps_64 ({result.rps:.0f} req/s under py-spy):")
        print(f"stacks in {speedscope} and {collapsed}")
        print(summarise_profile(text, top=25))
