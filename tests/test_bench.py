"""The gateway benchmark's quick mode as a CI check (`bench/gateway.py --quick --no-nginx`).

It checks that the benchmark runs and writes complete JSON lines, and fails only on a gross
regression of the gateway: the bounds below are far from the issue's targets on purpose. CI
machines are shared and noisy, and a tight timed assertion would fail for reasons that have
nothing to do with the code. `python bench/gateway.py` (the full run) is the measurement; this is
a tripwire.

nginx is left out (`--no-nginx`): its numbers are a reference for people, nothing here asserts on
them, and the run is shorter without it. The minimal proxy runs (`--minimal`): it measures how fast
this host is in the same run, so a slow or stolen VM is not read as a slow gateway.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
QUICK_STREAMS = 200  # open streams in the quick mode's memory test

# The floors: the LOWER of half the target and half of what the gateway does today on a
# quiet machine (nothing else on the gateway's core). Today = 2026-12-02 on the 2-core x86-64
# development VM, while the gateway was being optimised; quiet runs minutes apart differed by up to
# 1.7x on this VM (the other tenants of the host), so "today" is the lowest quiet result:
#
#   metric                       target     today: full runs      quick runs        floor
#   requests/s at 64 clients     >= 4,000   2,352 and 3,452       2,008 - 3,411     1,000
#   streams/s, 32 x 64 chunks    >= 1,500   1,039 and 1,061         952 - 1,570       475
#
# (~1,000 requests/s when other work shared the gateway's core.) On a busy machine other processes
# take part of the gateway's core (the benchmark measures how much: `*_others`, from /proc/stat),
# and the floor shrinks in proportion: a CI runner that leaves the gateway 60 % of its core expects
# 60 % of the floor. Idle time of the gateway's own making is not excused. Raise the floors as the
# gateway gets faster; at its targets they are half the targets (2,000 and 750).
FLOORS = {
    "rps_64": min(4000 / 2, 2008 / 2),
    "streams_32": min(1500 / 2, 952 / 2),
}
# The same rule the other way round, for what must stay low: the more lenient of twice the target
# and twice what the gateway does today (also scaled for other processes on its core where timed).
CEILINGS = {
    # added latency at 1 client, p50: target 0.35 ms; today 0.37 - 0.51 ms
    "latency_1_p50_added": max(2 * 0.35, 2 * 0.5),
    # RSS with the quick run's 200 open streams; the target is 150 MB with 1,000 (today 99 MB with
    # 1,000, 70 MB with 200)
    "rss_streams_mb": 2 * 150,
    # RSS growth per 1,000 requests after warm-up: target 5 MB (today ~0); the quick run's 10,000
    # requests are too few for a precise figure, but a leak of whole requests shows
    "rss_growth_mb_per_1000": 4 * 5,
    # /health probe latency while 32 MiB bodies go through: target p99 50 ms, so 100 ms by the
    # twice-the-target rule. It was 84 - 118 ms while the affinity key hashed whole images on the
    # event loop; since long data: strings are set aside unparsed (gateway/blobs.py) it is 24 - 37 ms,
    # also on a VM three times slower than usual. The bound is on the median over the bodies of the
    # worst probe during each, not on the p99: the quick run's few dozen probes make the p99 their
    # maximum, and CI once measured 124 ms there from one stall that the other bodies did not see.
    # Today 13 - 14 ms; with the set-aside switched off 45 ms (tests/test_blobs.py catches that).
    # What fails is a stall over 100 ms on most bodies, the size of the old one.
    "lag_32m_worst_median": 2 * 50,
}
# A timed bound is also met when the gateway stays within the same gross margin of the targets
# scaled to this host by the minimal proxy, measured beside it in the same run (`<metric>_scaled`:
# target x minimal here / minimal where the targets were set). That one cancels what the share of
# a core cannot see: steal time on the clients' core, a host slower across the board. CI once
# measured +1.93 ms at one client (ceiling 1.5 ms) while the hypervisor stole 27 s of a 60 s run.
MARGIN = 2.0
# Timed bounds, and the phase whose share of the gateway's core scales them.
PHASE = {
    "rps_64": "rps_64",
    "streams_32": "streams_32",
    "latency_1_p50_added": "latency_1",
    "lag_32m_worst_median": "bodies",
}


def room(lines: list[dict[str, Any]], phase: str) -> float:
    """The share of the gateway's core that other processes left it during `phase` (1.0 when
    alone; at least 0.25, so a saturated runner still fails a gateway that collapsed)."""
    others = [
        line["value"]
        for line in lines
        if line["contender"] == "gateway" and line["metric"] == f"{phase}_others"
    ]
    return max(0.25, 1.0 - (others[0] if others else 0.0))


# What every run reports: for both contenders, and for the gateway alone.
BOTH = (
    "latency_1_p50",
    "latency_1_p99",
    "latency_1_rps",
    "rps_64",
    "rps_64_errors",
    "streams_32",
    "streams_32_errors",
    "stream_chunks",
    "ttft_1_p50",
    "ttft_1_p99",
    "body_16k",
    "body_32m",
    "body_4x8m",
)
# The targets the minimal proxy scales to this host.
SCALED = ("rps_64", "streams_32", "latency_1_p50_added", "ttft_1_p50_added")
GATEWAY_ONLY = (
    "latency_1_cpu_ms",
    "rps_64_cpu_ms",
    "streams_32_cpu_ms",
    "latency_1_core",
    "rps_64_core",
    "streams_32_core",
    "latency_1_p50_added",
    "latency_1_p99_added",
    "ttft_1_p50_added",
    "ttft_1_p99_added",
    "body_16k_added",
    "body_32m_added",
    "body_4x8m_added",
    "rss_idle_mb",
    "rss_streams_mb",
    "streams_open",
    "rss_growth_mb_per_1000",
    "lag_idle_p50",
    "lag_idle_p99",
    "lag_p50",
    "lag_p99",
    "lag_32m_p50",
    "lag_32m_p99",
    "lag_32m_worst_median",
    "lag_4x8m_p50",
    "lag_4x8m_p99",
    "lag_4x8m_worst_median",
)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    if shutil.which("wrk") is None:
        pytest.fail(
            "wrk is not installed: apt-get install wrk (scripts/install-system; CI has it)", pytrace=False
        )
    out = tmp_path_factory.mktemp("bench") / "gateway.jsonl"
    command = [sys.executable, "bench/gateway.py", "--quick", "--no-nginx", "--minimal", "--out", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # the benchmark stops everything it started on SIGTERM
        stdout, stderr = process.communicate(timeout=30)
        pytest.fail(f"the quick benchmark took over 240 s\n{stdout}\n{stderr}")
    assert process.returncode == 0, f"{stdout}\n{stderr}"
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return lines, stdout


def on_this_host(lines: list[dict[str, Any]], metric: str) -> float | None:
    """The gross bound relative to the minimal proxy, or None when it has no figure for `metric`."""
    scaled = [line["value"] for line in lines if line["metric"] == metric + "_scaled"]
    if not scaled:
        return None
    return scaled[0] * MARGIN if metric.endswith("_added") else scaled[0] / MARGIN


def value(lines: list[dict[str, Any]], contender: str, metric: str) -> float:
    found = [line["value"] for line in lines if line["contender"] == contender and line["metric"] == metric]
    assert len(found) == 1, f"{contender} {metric}: {found}"
    result: float = found[0]
    return result


def test_json_lines_are_valid_and_complete(quick_run: tuple[list[dict[str, Any]], str]) -> None:
    lines, _ = quick_run
    assert lines
    for line in lines:
        assert line["bench"] == "gateway"
        assert line["mode"] == "quick"
        assert line["date"] and line["commit"]
        assert line["machine"]["arch"] and line["machine"]["nproc"] >= 1
        assert line["contender"] in ("direct", "gateway", "minimal")
        assert isinstance(line["value"], int | float) and math.isfinite(line["value"]), line
        assert isinstance(line["unit"], str)
    assert len({line["run"] for line in lines}) == 1
    have = {(line["contender"], line["metric"]) for line in lines}
    wanted = (
        {(c, m) for c in ("direct", "gateway", "minimal") for m in BOTH}
        | {("gateway", m) for m in GATEWAY_ONLY}
        | {("gateway", m + "_scaled") for m in SCALED}
    )
    assert not wanted - have, f"missing: {sorted(wanted - have)}"
    assert len(have) == len(lines), "one line per contender and metric"


def test_the_table_is_printed(quick_run: tuple[list[dict[str, Any]], str]) -> None:
    _, stdout = quick_run
    for label in ("requests/s, 64 clients", "streams/s, 32 clients", "RSS, 200 open streams", "target"):
        assert label in stdout


def test_throughput_is_not_grossly_below_today(quick_run: tuple[list[dict[str, Any]], str]) -> None:
    lines, _ = quick_run
    for metric, floor in FLOORS.items():
        share = room(lines, PHASE[metric])
        measured = value(lines, "gateway", metric)
        relative = on_this_host(lines, metric)
        assert measured >= floor * share or (relative is not None and measured >= relative), (
            f"{metric}: {measured:.0f} < {floor:.0f} x {share:.2f} of a core, and < {relative} on this host"
        )
        assert value(lines, "gateway", metric + "_errors") == 0
        assert value(lines, "direct", metric + "_errors") == 0
    for contender in ("direct", "gateway"):
        assert value(lines, contender, "stream_chunks") == 64


def test_latency_memory_and_lag_are_not_grossly_above_today(
    quick_run: tuple[list[dict[str, Any]], str],
) -> None:
    lines, _ = quick_run
    assert value(lines, "gateway", "streams_open") == QUICK_STREAMS
    for metric, ceiling in CEILINGS.items():
        bound = ceiling / room(lines, PHASE[metric]) if metric in PHASE else ceiling
        measured = value(lines, "gateway", metric)
        relative = on_this_host(lines, metric)
        assert measured <= bound or (relative is not None and measured <= relative), (
            f"{metric}: {measured:.3f} > {bound:.3f}, and > {relative} on this host\n"
            + "\n".join(json.dumps(line) for line in lines if line["metric"].startswith(metric.split("_")[0]))
        )


def test_targets_scale_by_what_the_minimal_proxy_measures_here() -> None:
    """A host half as fast as the one the targets were set on owes half the throughput and may add
    twice the latency; the summary says pass or FAIL against the scaled bound."""
    from bench.proxycost.report import MINIMAL_THERE, Recorder, scale_targets, scaled_summary

    rec = Recorder({})
    for key, there in MINIMAL_THERE.items():
        slower = there * 2 if key.endswith("_added") else there / 2
        rec.add("minimal", key, slower, "")
    rec.add("gateway", "rps_64", 2100, "req/s")  # scaled target 2,000: pass
    rec.add("gateway", "streams_32", 700, "/s")  # scaled target 750: FAIL
    rec.add("gateway", "latency_1_p50_added", 0.69, "ms")  # scaled 0.70 ms: pass
    scale_targets(rec)
    assert rec.get("gateway", "rps_64_scaled") == 2000
    assert rec.get("gateway", "streams_32_scaled") == 750
    assert rec.get("gateway", "latency_1_p50_added_scaled") == 0.7
    assert rec.get("gateway", "ttft_1_p50_added_scaled") == 1.0  # scaled even where the gateway has no figure
    summary = scaled_summary(rec).splitlines()
    assert "minimal proxy" in summary[0]
    rows = {line.split()[0]: line for line in summary[1:]}
    assert set(rows) == {"rps_64", "streams_32", "latency_1_p50_added"}
    assert rows["rps_64"].endswith("pass") and ">= 2,000" in rows["rps_64"]
    assert rows["streams_32"].endswith("FAIL")
    assert rows["latency_1_p50_added"].endswith("pass") and "+0.700 ms" in rows["latency_1_p50_added"]
