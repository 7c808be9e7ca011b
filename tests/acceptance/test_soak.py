"""`python -m bench.soak` in its CI form: half a minute of streaming, half the clients hanging up.

Behaviour only: every stream ends as it should, memory does not run away, no upstream connection is
left behind. No time is compared with a bound (the probe's lag is checked to be reported, not how
long it is)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_short_soak_holds_memory_latency_and_connections(tmp_path: Path) -> None:
    out = tmp_path / "soak.jsonl"
    command = [
        sys.executable,
        "-m",
        "bench.soak",
        "--duration",
        "30",
        "--warmup",
        "10",
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True, timeout=180, capture_output=True, cwd=ROOT)
    result = json.loads(out.read_text().splitlines()[-1])
    outcomes = result["outcomes"]
    # Both kinds of stream happened (how many in 30 s is a speed: not bounded here).
    assert outcomes.get("done", 0) > 0 and outcomes.get("aborted", 0) > 0, outcomes
    assert outcomes.get("failed", 0) == 0 and outcomes.get("cut", 0) == 0, outcomes
    assert outcomes.get("error", 0) == 0, outcomes  # every stream answered 200, none an error event
    # Memory, not time: a bound well above what a quiet machine shows (~2 MB), so a leak, not noise.
    assert result["rss_growth_mb"] < 10
    assert math.isfinite(result["lag_ms_p99"]) and result["lag_ms_p99"] > 0
    assert result["upstream_connections_after"] <= 2  # the health prober keeps one alive
