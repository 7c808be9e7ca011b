"""The monitoring assets in deploy/: the Prometheus config, the alert rules and their unit tests, and
the Grafana dashboard, checked with promtool and against the metric names the real gateway exposes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.harness import eventually, run_gateway
from tests.support.servers import sim_replica

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "fleet-gateway.json"

# Series the assets may use before the gateway exposes them, each with a comment on what is coming.
# gateway_prefix_* and gateway_backend_* stood here until they landed; when a planned one lands,
# test_planned_names_are_not_exposed_yet fails as a reminder to take it off this list.
PLANNED: set[str] = set()
# Made by Prometheus for every scrape target, not by the gateway (GatewayDown uses it).
FROM_PROMETHEUS = {"up"}

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right"}
PROMQL_WORDS |= {"offset", "bool", "inf", "nan"}


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not on PATH: apt-get install prometheus (CI installs it)", pytrace=False)
    return subprocess.run(
        [exe, *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{result.args}:\n{result.stdout}\n{result.stderr}"


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers,
    ranges, grouping label lists, function calls, keywords and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        name, call = match.groups()
        if not call and name.lower() not in PROMQL_WORDS:
            names.add(name)
    return names


def test_metric_names_parser() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (preset, le) (rate(a_bucket{x="y{z}",q=~"$preset"}[$__rate_interval])))'
        " > 1e3 and on (preset) (b offset 1h) / ignoring (status) group_left sum without (kind) (c:rec)"
    )
    assert metric_names(expr) == {"a_bucket", "b", "c:rec"}


# ---- the gateway's real exposition


# Series the requests below leave behind; the fixture waits for them.
RECORDED = (
    'gateway_tokens_total{kind="cached",preset="dense",replica="d0"}',
    'gateway_requests_total{engine="none",preset="unknown"',
    'gateway_thinking_budget_exhausted_total{preset="thinker",replica="t0"} 1.0',
    'gateway_prefix_volatile_total{kind="timestamp",preset="dense"} 1.0',
    'gateway_prefix_churn_total{preset="dense"} 1.0',
)


@pytest.fixture(scope="module")
def exposition() -> Iterator[str]:
    """/metrics of a gateway over a vLLM and a llama.cpp simulator, after a few requests: a stream,
    a repeat that hits the prefix cache, a timestamp in the system prompt (volatile content and
    prefix churn), a thinking trap and an unknown model."""
    dense, thinker = (
        sim_replica("vllm", "dense-served"),
        sim_replica("llamacpp", "thinker-served", reasoning_tokens=300),
    )
    table = f"""
defaults: {{prefix: {{volatile: warn}}}}
presets:
  dense:
    served_model: dense-served
    replicas: [{{name: d0, url: "{dense.url}", engine: vllm}}]
  thinker:
    served_model: thinker-served
    thinking: true
    min_max_tokens: 0
    replicas: [{{name: t0, url: "{thinker.url}", engine: llamacpp}}]
routing: {{default: dense}}
"""
    system = {"role": "system", "content": "A long and stable system prompt. " * 40}
    messages = [system, {"role": "user", "content": "hello"}]
    stamped = {"role": "system", "content": system["content"] + "Current time: 2026-12-02T12:00:00Z"}
    try:
        with run_gateway(table) as gw, httpx2.Client(base_url=gw.url, timeout=30) as client:
            for body in (
                {"model": "dense", "messages": messages, "stream": True},
                {"model": "dense", "messages": messages, "stream": True},
                {"model": "dense", "messages": [stamped, *messages[1:]], "stream": True},
                {"model": "thinker", "messages": messages, "max_tokens": 50},
                {"model": "no-such-model", "messages": messages},
            ):
                client.post("/v1/chat/completions", json=body)

            def recorded() -> str | None:
                # The gateway records a request just after its last byte: wait for the last ones.
                text = client.get("/metrics").text
                return text if all(marker in text for marker in RECORDED) else None

            text = eventually(recorded)
            assert text, f"the gateway did not record {RECORDED} in time"
            yield text
    finally:
        dense.stop()
        thinker.stop()


@pytest.fixture(scope="module")
def exposed(exposition: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(exposition):
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def test_the_exposition_has_the_series_the_assets_need(exposition: str, exposed: set[str]) -> None:
    for name in (
        "gateway_requests_total",
        "gateway_tokens_total",
        "gateway_replica_up",
        "gateway_panic_mode",
    ):
        assert name in exposed
    assert 'kind="cached"' in exposition
    assert re.search(r'^gateway_time_to_first_token_seconds_count\{preset="dense"', exposition, re.M)


def test_promtool_check_metrics(exposition: str) -> None:
    # Exit 3 means lint problems (naming conventions): print them, do not fail. Anything else is an error.
    result = promtool("check", "metrics", stdin=exposition)
    if result.returncode == 3:
        print("promtool check metrics warnings:\n" + result.stdout + result.stderr)
    else:
        assert_ok(result)


def test_planned_names_are_not_exposed_yet(exposed: set[str]) -> None:
    landed = PLANNED & exposed
    assert not landed, f"{sorted(landed)} are exposed now: remove them from PLANNED"


# ---- Prometheus


def test_prometheus_config() -> None:
    assert_ok(promtool("check", "config", str(PROMETHEUS / "prometheus.yml")))


def test_alert_rules() -> None:
    assert_ok(promtool("check", "rules", str(PROMETHEUS / "alerts.yml")))


def test_alert_rules_unit_tests() -> None:
    assert_ok(promtool("test", "rules", str(PROMETHEUS / "alerts_test.yml")))


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_alert_has_for_severity_and_annotations() -> None:
    rules = alert_rules()
    tested = (PROMETHEUS / "alerts_test.yml").read_text()
    for rule in rules:
        assert rule.get("for"), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]
        assert f"alertname: {rule['alert']}\n" in tested, f"{rule['alert']} has no unit test"


def test_alert_rules_use_only_exposed_metrics(exposed: set[str]) -> None:
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        unknown = names - exposed - PLANNED - FROM_PROMETHEUS
        assert not unknown, f"{rule['alert']}: {sorted(unknown)} are not gateway metrics"


# ---- Grafana


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard["panels"]:
        panels += [panel, *panel.get("panels", [])]
    return panels


def panel_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (f"{panel['title']} ({panel['id']}{target['refId']})", target["expr"])
        for panel in all_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    panels = all_panels(dashboard)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert {"preset", "replica"} <= variables.keys()
    rows = [panel for panel in panels if panel["type"] == "row"]
    assert [row.get("repeat") for row in rows] == [None, "preset", None]
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert panel["targets"], panel["title"]


def grafana_to_promql(expr: str) -> str:
    expr = re.sub(r"\$\{?__\w+\}?", "5m", expr)  # $__rate_interval, $__interval, $__range
    return re.sub(r"\$\{?\w+(?::\w+)?\}?", "x", expr)  # $preset, ${replica}, ${preset:regex}


def test_dashboard_promql_is_valid(dashboard: dict[str, Any], tmp_path: Path) -> None:
    # promtool has no "check this expression"; checking each one as a recording rule parses it.
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": grafana_to_promql(expr), "labels": {"panel": where}}
        for i, (where, expr) in enumerate(panel_exprs(dashboard))
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert_ok(promtool("check", "rules", str(path)))


def test_dashboard_uses_only_exposed_metrics(dashboard: dict[str, Any], exposed: set[str]) -> None:
    known = exposed | PLANNED
    for where, expr in panel_exprs(dashboard):
        names = metric_names(expr)
        assert names, where
        assert names <= known, f"{where}: {sorted(names - known)} are not gateway metrics"
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            name = re.match(r"label_values\(\s*([A-Za-z_:][\w:]*)", var["definition"])
            assert name and name[1] in exposed, var["name"]
