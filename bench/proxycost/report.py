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
    # Per contender, what each of its lines also records (a revision's commit, a team's keys).
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, contender: str, metric: str, value: float, unit: str, **detail: Any) -> None:
        line = {
            **self.common,
            **self.tags.get(contender, {}),
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


@dataclass(frozen=True)
class Figure:
    """One figure of the comparison between gateways: a recorded metric, shown x `scale` in `unit`."""

    label: str
    metric: str
    unit: str
    scale: float
    better: str  # "lower" or "higher"


# The gateway's own cost in five figures: what `--against` compares between revisions.
FIGURES = (
    Figure("added latency, 1 client, p50", "latency_1_p50_added", "ms", 1, "lower"),
    Figure("requests/s, 64 clients", "rps_64", "req/s", 1, "higher"),
    Figure("CPU per request, 64 clients", "rps_64_cpu_ms", "us", 1000, "lower"),
    Figure("added time to first token, 1 client, p50", "ttft_1_p50_added", "ms", 1, "lower"),
    Figure("CPU per stream (64 chunks), 32 clients", "streams_32_cpu_ms", "us", 1000, "lower"),
)
CURRENT = "gateway"
TEAM = "gateway+team"
WITHIN = 0.10  # "the same figures with named keys and limits within 10 %"


def ratio_pairs(names: list[str]) -> list[tuple[str, str]]:
    """(numerator, denominator) of each ratio: this checkout over each revision (`gateway@...`),
    and the gateway with a team over the same without one."""
    pairs = [(CURRENT, name) for name in names if name.startswith(CURRENT + "@")]
    if TEAM in names:
        pairs.append((TEAM, CURRENT))
    return pairs


def _ratio(rec: Recorder, figure: Figure, numerator: str, denominator: str) -> float | None:
    top, bottom = rec.get(numerator, figure.metric), rec.get(denominator, figure.metric)
    if top is None or bottom is None or bottom <= 0 or top < 0:
        return None
    return top / bottom


def record_ratios(rec: Recorder, names: list[str]) -> None:
    """Each figure's ratio as a JSON line `<metric>_ratio`, on the contender that is not this
    checkout's plain gateway (the revision, or the gateway with a team)."""
    for numerator, denominator in ratio_pairs(names):
        owner = denominator if numerator == CURRENT else numerator
        for figure in FIGURES:
            ratio = _ratio(rec, figure, numerator, denominator)
            if ratio is not None:
                rec.add(
                    owner,
                    figure.metric + "_ratio",
                    ratio,
                    "x",
                    of=numerator,
                    to=denominator,
                    better=figure.better,
                )


def worse_by(ratio: float, better: str) -> float:
    """How much worse the numerator is, as a fraction (negative: better)."""
    return ratio - 1 if better == "lower" else 1 / ratio - 1


def _verdict(ratio: float, better: str) -> str:
    change = worse_by(ratio, better)
    return "level" if abs(change) < 0.005 else "worse" if change > 0 else "better"


def comparison(rec: Recorder, names: list[str]) -> str:
    """The five figures for every contender, and the ratio of each pair of gateways; empty when
    the run had no second gateway."""
    pairs = ratio_pairs(names)
    if not pairs:
        return ""
    header = ["figure", "unit", "better", *names, *(f"{a} / {b}" for a, b in pairs)]
    rows = [header]
    for figure in FIGURES:
        values = [rec.get(name, figure.metric) for name in names]
        cells = [figure.label, figure.unit, figure.better]
        cells += [_fmt(None if v is None else v * figure.scale, figure.unit) for v in values]
        for numerator, denominator in pairs:
            ratio = _ratio(rec, figure, numerator, denominator)
            cells.append("-" if ratio is None else f"{ratio:.2f}x {_verdict(ratio, figure.better)}")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "the gateway against its other revisions"
        + (" and with a team's keys and limits" if TEAM in names else "")
        + ": each ratio is the first named over the second; 'better' says which way is better",
        "",
    ]
    for n, cells in enumerate(rows):
        padded = [
            c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        lines.append("  ".join(padded).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    if TEAM in names:
        lines.append("\n" + team_verdict(rec))
    return "\n".join(lines)


def team_verdict(rec: Recorder) -> str:
    """Whether the gateway with named keys and limits keeps within 10 % of itself without them."""
    beyond = []
    for figure in FIGURES:
        ratio = _ratio(rec, figure, TEAM, CURRENT)
        if ratio is None:
            beyond.append(f"{figure.label} (not measured)")
        elif worse_by(ratio, figure.better) > WITHIN:
            beyond.append(f"{figure.label} ({100 * worse_by(ratio, figure.better):+.0f} %)")
    within = f"{WITHIN * 100:.0f} %"
    if not beyond:
        return f"with named keys and limits: within {within} of the gateway without them on every figure"
    return f"with named keys and limits: more than {within} worse on " + "; ".join(beyond)


def _parse_stacks(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) format: `frame;frame;... count` per line, the leaf last."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def _package(module: str) -> str:
    """`gateway/pipeline/proxy.py` -> `gateway/pipeline` (a step of the request path);
    `uvicorn/protocols/http/httptools_impl.py` -> `uvicorn`; `asyncio/events.py` -> `asyncio`."""
    parts = module.split("/")
    if parts[0] == "gateway" and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0].removesuffix(".py")


def summarise_profile(text: str, top: int = 25) -> str:
    """The functions with the most samples of their own (self time), grouped by module, each with
    its share of all samples and the share of samples it was on the stack for (total); then the
    self time by package (the gateway's by subpackage: the steps of a request)."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for stack, n in _parse_stacks(text):
        samples += n
        frames = [_frame(frame) for frame in stack]
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + n
    if not samples:
        return "no samples"
    modules: dict[str, int] = {}
    packages: dict[str, int] = {}
    for frame, n in own.items():
        module = _module(frame)
        modules[module] = modules.get(module, 0) + n
        packages[_package(module)] = packages.get(_package(module), 0) + n
    chosen = sorted(own.items(), key=lambda item: -item[1])[:top]
    by_module: dict[str, list[tuple[str, int]]] = {}
    for frame, n in chosen:
        by_module.setdefault(_module(frame), []).append((frame, n))
    share = sum(n for _, n in chosen)
    lines = [
        f"the top {len(chosen)} functions by self time ({100 * share / samples:.1f} % of {samples} samples"
        " of the gateway's busy time), grouped by module",
        f"{'self %':>7} {'total %':>7}  module (its self % over all its functions) / function",
    ]
    for module, functions in sorted(by_module.items(), key=lambda item: -modules[item[0]]):
        lines.append(f"{100 * modules[module] / samples:7.1f} {'':>7}  {module}")
        for frame, n in functions:
            name = frame.partition(" (")[0]
            lines.append(f"{100 * n / samples:7.1f} {100 * total[frame] / samples:7.1f}    {name}")
    lines.append(f"\n{'self %':>7}  package")
    for package, n in sorted(packages.items(), key=lambda item: -item[1])[:16]:
        lines.append(f"{100 * n / samples:7.1f}  {package}")
    return "\n".join(lines)


def _module(frame: str) -> str:
    return frame.partition(" (")[2].removesuffix(")") or "?"


def to_speedscope(text: str, name: str) -> dict[str, Any]:
    """py-spy's collapsed stacks as one speedscope `sampled` profile (weights: sample counts)."""
    frames: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    samples: list[list[int]] = []
    weights: list[int] = []
    for stack, n in _parse_stacks(text):
        indices = []
        for frame in stack:
            if frame not in index:
                function, _, where = frame.partition(" (")
                file, _, line = where.removesuffix(")").rpartition(":")
                entry: dict[str, Any] = {"name": function, "file": file or where.removesuffix(")")}
                if line.isdigit():
                    entry["line"] = int(line)
                index[frame] = len(frames)
                frames.append(entry)
            indices.append(index[frame])
        samples.append(indices)
        weights.append(n)
    profile = {
        "type": "sampled",
        "name": name,
        "unit": "none",
        "startValue": 0,
        "endValue": sum(weights),
        "samples": samples,
        "weights": weights,
    }
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [profile],
        "name": name,
        "activeProfileIndex": 0,
        "exporter": "bench.gateway",
    }


def _frame(frame: str) -> str:
    """`func (/.../site-packages/aiohttp/client.py:819)` -> `func (aiohttp/client.py)`."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for marker in ("site-packages/", f"{ROOT}/", "/lib/python3.11/", "/lib/python3.12/", "/lib/python3.13/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{name} ({path})"
