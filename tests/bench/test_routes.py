"""The benchmark's routes table runs every gateway with the shipped routes.yaml's defaults."""

from __future__ import annotations

from pathlib import Path

import yaml

from bench.proxycost.routes import SHIPPED_DEFAULTS, SHIPPED_HEALTH

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_with_the_shipped_defaults_and_health_settings() -> None:
    shipped = yaml.safe_load((ROOT / "routes.yaml").read_text())
    # `compat` is left out: older revisions compared by `--against` do not know every fix's name, and
    # the fixes act on tools and on Messages and Responses fields, which its chat requests lack.
    defaults = {k: v for k, v in shipped["defaults"].items() if k != "compat"}
    assert defaults == SHIPPED_DEFAULTS
    assert shipped["health"] == SHIPPED_HEALTH
