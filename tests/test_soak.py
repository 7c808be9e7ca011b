"""bench/soak.py in its CI form: half a minute of streaming, half the clients hanging up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_short_soak_holds_memory_latency_and_connections(tmp_path: Path) -> None:
    out = tmp_path / "soak.jsonl"
    command = [
        sys.executable,
        str(ROOT / "bench" / "soak.py"),
        "--duration",
        "30",
        "--warmup",
        "10",
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True, timeout=180, capture_output=True)
    result = json.loads(out.read_text().splitlines()[-1])
    outcomes = result["outcomes"]
    assert outcomes.get("done", 0) > 100 and outcomes.get("aborted", 0) > 100, outcomes
    assert outcomes.get("failed", 0) == 0 and outcomes.get("cut", 0) == 0, outcomes
    # Bounds well above what a quiet machine shows (~2 MB, ~20 ms): a leak or a stall, not noise.
    assert result["rss_growth_mb"] < 10
    assert result["lag_ms_p99"] < 200
    assert result["upstream_connections_after"] <= 2  # the health prober keeps one alive
