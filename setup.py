"""The build's one option: `GATEWAY_COMPILE=1` compiles the request path with mypyc.

Everything else about the package is in pyproject.toml. Without the variable the build is pure
Python, as in development, where a compiled module beside its source would shadow every edit. The
Docker image is built compiled: the request path runs about a third fewer instructions
(docs/benchmarks.md). mypyc must be importable, so build without isolation:

    pip install setuptools mypy && GATEWAY_COMPILE=1 pip install --no-build-isolation .
"""

from __future__ import annotations

import glob
import os

from setuptools import setup

# What every request runs through. Left out: the pydantic models read once at start (the routes
# table, the keys), the edge's protocol (a subclass of uvicorn's, which a compiled class cannot
# be), and what runs outside requests (the supervisor, the CLI, the tools, MCP).
COMPILED = (
    "gateway/answers/*.py",
    "gateway/dialects/*.py",
    "gateway/pipeline/*.py",
    "gateway/relay/*.py",
    "gateway/edge/auth.py",
    "gateway/edge/browser.py",
    "gateway/edge/door.py",
    "gateway/edge/guard.py",
    "gateway/edge/paths.py",
    "gateway/edge/reject.py",
    "gateway/fleet/health.py",
    "gateway/fleet/replicas.py",
    "gateway/fleet/slots.py",
    "gateway/ops/accesslog.py",
    "gateway/ops/exchange.py",
    "gateway/ops/metrics.py",
    "gateway/ops/recent.py",
    "gateway/ops/tally.py",
    "gateway/routing/balancer.py",
    "gateway/routing/fallback.py",
    "gateway/routing/route.py",
    "gateway/team/gates.py",
    "gateway/team/limits.py",
    "gateway/team/state.py",
    "gateway/team/team.py",
    "gateway/team/windows.py",
    "gateway/upstream/lean_client.py",
    "gateway/caught.py",
    "gateway/lru.py",
    "gateway/types.py",
)


def compiled_modules() -> list[str]:
    return sorted({path for pattern in COMPILED for path in glob.glob(pattern)})


def ext_modules() -> list[object]:
    if os.environ.get("GATEWAY_COMPILE") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as error:
        raise SystemExit(
            "GATEWAY_COMPILE=1 needs mypyc: pip install mypy, then build with --no-build-isolation"
        ) from error
    # The project's mypy settings (pyproject.toml) apply: the same strict checking as `scripts/check`.
    return list(mypycify(compiled_modules(), opt_level="3"))


# setuptools runs this file as __main__ (`pip install`, `python setup.py`); the tests read the list.
if __name__ == "__main__":
    setup(ext_modules=ext_modules())
