"""The results: the targets, the JSON lines (`Recorder`), the table and the targets scaled to this
machine, and the summary of a py-spy profile."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bench.proxycost.constants import CHUNKS, ROOT

# The targets for the gateway (one core, an instant upstream, shipped defaults): metric ->
# (comparison, bound). `_added` metrics are the gateway's value minus direct's, paired per round.
TARGETS: dict[str, tuple[str, float]] = {
    "latency_1_p50_added": ("<=", 0.35),
    "latency_1_p99_added": ("<=", 1.0),
    "rps_64": (">=", 4000),
    "rps_64_errors": ("<=", 0),
    "streams_32": (">=", 1500),
    "streams_32_errors": ("<=", 0),
    "stream_chunks": ("==", CHUNKS),
    "ttft_1_p50_added": ("<=", 0.5),
    "rss_streams_mb": ("<=", 150),  # with 1,000 open streams
    "rss_growth_mb_per_1000": ("<=", 5),
    "lag_p99": ("<=", 50),
}

# The minimal proxy's figures in the harness where the targets were set (the performance issue).
# The same proxy run here gives this machine's speed: a target scaled by here / there is what the
# gateway owes on this host.
MINIMAL_THERE: dict[str, float] = {
    "rps_64": 6800,
    "streams_32": 2600,
    "latency_1_p50_added": 0.37,
    "ttft_1_p50_added": 0.52,
}


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q % of the values at or below it."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class Recorder:
    """Measurements as JSON lines: one per contender and metric, with the samples behind it."""

    common: dict[str, Any]
    lines: list[dict[str, Any]] = field(default_factory=list)

    def add(self, contender: str, metric: str, value: float, unit: str, **detail: Any) -> None:
        line = {
            **self.common,
            "contender": contender,
            "metric": metric,
            "value": round(value, 4) if math.isfinite(value) else None,  # JSON has no NaN
            "unit": unit,
        }
        if detail:
            line["detail"] = detail
        self.lines.append(line)

    def detail(self, contender: str, metric: str) -> dict[str, Any] | None:
        for line in self.lines:
            if line["contender"] == contender and line["metric"] == metric:
                found: dict[str, Any] = line.get("detail", {})
                return found
        return None

    def get(self, contender: str, metric: str) -> float | None:
        for line in self.lines:
            if line["contender"] == contender and line["metric"] == metric:
                value: float | None = line["value"]
                return value
        return None


def _fmt(value: float | None, unit: str) -> str:
    if value is None or math.isnan(value):
        return "-"
    if abs(value) >= 100 or (unit == "" and value == int(value)):
        return f"{value:,.0f}"
    return f"{value:.3f}"


@dataclass(frozen=True)
class Row:
    label: str
    metric: str
    unit: str
    compare: str = ""  # "added": the gateway's `_added` line; "ratio": gateway / direct
    target: str = ""  # a key of TARGETS


ROWS = (
    Row("latency, 1 client, p50", "latency_1_p50", "ms", "added", "latency_1_p50_added"),
    Row("latency, 1 client, p99", "latency_1_p99", "ms", "added", "latency_1_p99_added"),
    Row("requests/s, 1 client", "latency_1_rps", "req/s", "ratio"),
    Row("  proxy CPU per request", "latency_1_cpu_ms", "ms"),
    Row("requests/s, 64 clients", "rps_64", "req/s", "ratio", "rps_64"),
    Row("  errors", "rps_64_errors", "", "", "rps_64_errors"),
    Row("  proxy CPU per request", "rps_64_cpu_ms", "ms"),
    Row("  proxy busy (share of its core)", "rps_64_core", "cores"),
    Row("  its core taken by others", "rps_64_others", "cores"),
    Row("streams/s, 32 clients x 64 chunks", "streams_32", "/s", "ratio", "streams_32"),
    Row("  errors", "streams_32_errors", "", "", "streams_32_errors"),
    Row("  chunks per stream", "stream_chunks", "", "", "stream_chunks"),
    Row("  proxy CPU per stream", "streams_32_cpu_ms", "ms"),
    Row("  proxy busy (share of its core)", "streams_32_core", "cores"),
    Row("  its core taken by others", "streams_32_others", "cores"),
    Row("first token, 1 client, p50", "ttft_1_p50", "ms", "added", "ttft_1_p50_added"),
    Row("first token, 1 client, p99", "ttft_1_p99", "ms", "added"),
    Row("RSS idle", "rss_idle_mb", "MB"),
    Row("RSS, {streams} open streams", "rss_streams_mb", "MB", "", "rss_streams_mb"),
    Row("RSS growth per 1,000 requests", "rss_growth_mb_per_1000", "MB", "", "rss_growth_mb_per_1000"),
    Row("16k-token body (64 KB)", "body_16k", "ms", "added"),
    Row("32 MiB body", "body_32m", "ms", "added"),
    Row("4 concurrent 8 MiB bodies", "body_4x8m", "ms", "added"),
    Row("/health probe, idle, p50", "lag_idle_p50", "ms"),
    Row("/health probe, idle, p99", "lag_idle_p99", "ms"),
    Row("/health during big bodies, p50", "lag_p50", "ms"),
    Row("/health during big bodies, p99", "lag_p99", "ms", "", "lag_p99"),
    Row("  during the 32 MiB ones, p99", "lag_32m_p99", "ms"),
    Row("  during the 4 x 8 MiB ones, p99", "lag_4x8m_p99", "ms"),
    Row("  worst per 32 MiB body, median", "lag_32m_worst_median", "ms"),
)


def meets(rec: Recorder, key: str) -> bool | None:
    """Whether the gateway meets TARGETS[key]; None when it was not measured."""
    value = rec.get("gateway", key)
    if value is None or math.isnan(value):
        return None
    op, bound = TARGETS[key]
    return value <= bound if op == "<=" else value >= bound if op == ">=" else value == bound


def _target_text(key: str) -> str:
    op, bound = TARGETS[key]
    text = f"{bound:,g}"
    if key.endswith("_added"):
        text = f"+{bound:g} ms"
    elif key.endswith("_mb") or key.endswith("_per_1000"):
        text += " MB"
    elif key.startswith("lag"):
        text += " ms"
    return f"{op} {text}"


def table(rec: Recorder, names: list[str]) -> str:
    minimal = "minimal" in names
    header = [
        "metric",
        "unit",
        *names,
        "gateway vs direct",
        *(["vs minimal"] if minimal else []),
        "target",
        "result",
    ]
    rows = [header]
    for row in ROWS:
        values = [rec.get(name, row.metric) for name in names]
        if all(v is None for v in values):
            continue
        streams = (rec.detail("gateway", row.metric) or {}).get("streams", 0)
        label = row.label.format(streams=f"{streams:,}")
        cells = [label, row.unit, *(_fmt(v, row.unit) for v in values)]
        direct, gateway = rec.get("direct", row.metric), rec.get("gateway", row.metric)
        if row.compare == "added":
            added = rec.get("gateway", row.metric + "_added")
            cells.append("-" if added is None else f"{added:+.3f} ms")
        elif row.compare == "ratio" and direct and gateway is not None:
            cells.append(f"{gateway / direct:.3f}x")
        else:
            cells.append("")
        if minimal:
            cells.append(_versus_minimal(rec, row))
        verdict = meets(rec, row.target) if row.target else None
        cells += [
            _target_text(row.target) if row.target else "",
            {None: "", True: "pass", False: "FAIL"}[verdict],
        ]
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for n, cells in enumerate(rows):
        padded = [
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        lines.append("  ".join(padded).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _versus_minimal(rec: Recorder, row: Row) -> str:
    if row.compare == "added":
        gateway, minimal = (
            rec.get("gateway", row.metric + "_added"),
            rec.get("minimal", row.metric + "_added"),
        )
        return "" if gateway is None or minimal is None else f"{gateway - minimal:+.3f} ms"
    gateway, minimal = rec.get("gateway", row.metric), rec.get("minimal", row.metric)
    if row.compare == "ratio" and gateway is not None and minimal:
        return f"{gateway / minimal:.3f}x"
    return ""


def scale_targets(rec: Recorder) -> None:
    """Each target the minimal proxy has a reference figure for, scaled to this machine by what the
    minimal proxy measured here (recorded as `<target>_scaled`)."""
    for key, there in MINIMAL_THERE.items():
        here = rec.get("minimal", key)
        if here is None or here <= 0:
            continue
        op, bound = TARGETS[key]
        rec.add(
            "gateway",
            key + "_scaled",
            bound * here / there,
            "ms" if key.endswith("_added") else "/s",
            op=op,
            target=bound,
            minimal_here=here,
            minimal_there=there,
            gateway=rec.get("gateway", key),
        )


def scaled_summary(rec: Recorder) -> str:
    """The targets scaled to this machine, and whether the gateway meets them: a few lines."""
    lines = []
    for key, there in MINIMAL_THERE.items():
        scaled, detail = rec.get("gateway", key + "_scaled"), rec.detail("gateway", key + "_scaled")
        if scaled is None or detail is None or detail["gateway"] is None:
            continue
        op, gateway, here = detail["op"], detail["gateway"], detail["minimal_here"]
        ok = gateway <= scaled if op == "<=" else gateway >= scaled
        fmt = "{:+.3f} ms" if key.endswith("_added") else "{:,.0f}"
        lines.append(
            f"  {key:<20} minimal {fmt.format(here)} here, {fmt.format(there)} there:"
            f" {op} {fmt.format(detail['target'])} becomes {op} {fmt.format(scaled)};"
            f" gateway {fmt.format(gateway)}  {'pass' if ok else 'FAIL'}"
        )
    if not lines:
        return ""
    head = "targets scaled to this machine by the minimal proxy (bench.minimal_proxy), target x here / there:"
    return "\n".join([head, *lines])


def summarise_profile(text: str, top: int = 20) -> str:
    """py-spy's raw (collapsed) stacks -> the functions with the most samples of their own, and the
    same by package (gateway, uvicorn, aiohttp, starlette, the standard library...)."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    packages: dict[str, int] = {}
    samples = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = [_frame(frame) for frame in stack.split(";")]
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + n
        package = frames[-1].rpartition("(")[2].split("/")[0].removesuffix(")").removesuffix(".py")
        packages[package] = packages.get(package, 0) + n
    if not samples:
        return "no samples"
    lines = [f"{'self %':>7} {'total %':>7}  function ({samples} samples of the gateway's busy time)"]
    for frame, n in sorted(own.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"{100 * n / samples:7.1f} {100 * total[frame] / samples:7.1f}  {frame}")
    lines.append(f"\n{'self %':>7}  package")
    for package, n in sorted(packages.items(), key=lambda item: -item[1])[:12]:
        lines.append(f"{100 * n / samples:7.1f}  {package}")
    return "\n".join(lines)


def _frame(frame: str) -> str:
    """`func (/.../site-packages/aiohttp/client.py:819)` -> `func (aiohttp/client.py)`."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for marker in ("site-packages/", f"{ROOT}/", "/lib/python3.11/", "/lib/python3.12/", "/lib/python3.13/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{name} ({path})"
