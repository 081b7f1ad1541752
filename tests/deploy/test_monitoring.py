"""Alert rules and dashboard: promtool checks and unit-tests the rules; every metric the dashboard
and the rules query (read with a real PromQL parser) is exported by live services.

promtool comes with the Debian package ``prometheus``; without it the promtool tests are skipped
with the reason, except in CI (``$CI`` set) where a missing promtool is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_tools import ROOT, need

DASHBOARD = ROOT / "deploy" / "grafana" / "onpolicy.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "rules.test.yaml"
# Grafana's interval variables are not PromQL: stand-ins of the same kind (a duration).
GRAFANA_DURATIONS = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "1m"}
# Queried by the dashboard, exported by the job controller (its aggregated /metrics), not by a
# role service. Reward is known to the controller only (rule-based rewards are computed there).
CONTROLLER_METRICS = {"onpolicy_job_reward_mean", "onpolicy_job_loss", "onpolicy_job_grad_norm",
                      "onpolicy_job_clip_fraction", "onpolicy_job_entropy", "onpolicy_job_eval_accuracy",
                      "onpolicy_job_kl_k3"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        msg = "promtool is not installed (apt-get install -y prometheus)"
        if os.environ.get("CI"):
            pytest.fail(f"{msg}: CI must install it")
        pytest.skip(msg)
    return path


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"promtool {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


# ---- promtool ---------------------------------------------------------------------------------------

def test_promtool_check_rules() -> None:
    out = run_promtool("check", "rules", str(RULES), cwd=RULES.parent).stdout
    assert "SUCCESS: 4 rules found" in out, out


def test_promtool_rule_unit_tests() -> None:
    run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)


def test_rule_unit_tests_cover_every_alert() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert tested == alerts


def test_logdiff_alert_is_critical_and_immediate() -> None:
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    r = rules["OnpolicyLogdiffNonZero"]
    assert r["expr"].strip() == "max by (job, model) (onpolicy_logdiff_max) > 0"
    assert r["for"] == "0m" and r["labels"]["severity"] == "critical"


# ---- PromQL ----------------------------------------------------------------------------------------

def metric_names(expr: str) -> set[str]:
    """Metric names of every vector selector in ``expr`` (a real PromQL parse)."""
    promql_parser = need("promql_parser", "parses the dashboard's and rules' PromQL")
    for var, stand_in in GRAFANA_DURATIONS.items():
        expr = expr.replace(var, stand_in)
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"selector without a metric name in {expr!r}"
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
            assert m, var["query"]
            exprs.append(m.group(1))
    return exprs


def rule_queries() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def queried_metrics() -> set[str]:
    return set().union(*(metric_names(e) for e in dashboard_queries() + rule_queries()))


def test_promql_extraction_works() -> None:
    assert metric_names('sum by (le) (increase(onpolicy_logdiff_bucket{job=~"$job"}[$__rate_interval]))') \
        == {"onpolicy_logdiff_bucket"}
    assert metric_names("a > 0 and on (job) max by (job) (changes(b{role=\"trainer\"}[15m])) > 0 or 0 * c") \
        == {"a", "b", "c"}


def test_every_query_parses_and_names_onpolicy_metrics() -> None:
    names = queried_metrics()
    assert names and all(n.startswith("onpolicy_") for n in names), names
    for needed in ("onpolicy_logdiff_max", "onpolicy_logdiff_bucket", "onpolicy_tokens_mismatched_total",
                   "onpolicy_tokens_checked_total", "onpolicy_weight_version", "onpolicy_verification_lag_seconds",
                   "onpolicy_rollout_tokens_generated_total", "onpolicy_trainer_tokens_per_second",
                   "onpolicy_job_reward_mean"):
        assert needed in names, needed


# ---- the dashboard ----------------------------------------------------------------------------------

def test_dashboard_shape() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "onpolicy-consistency"
    ds = [v for v in dash["templating"]["list"] if v["name"] == "datasource"]
    assert ds and ds[0]["type"] == "datasource" and ds[0]["query"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:  # every query goes to the chosen data source
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
    # no two panels overlap on the 24-column grid
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not mine & cells, p["title"]
        cells |= mine
    by_metric = {m: [p for p in panels if any(m in t["expr"] for t in p["targets"])] for m in (
        "onpolicy_logdiff_max", "onpolicy_logdiff_bucket", "onpolicy_tokens_mismatched_total",
        "onpolicy_tokens_checked_total", "onpolicy_job_reward_mean", "onpolicy_rollout_tokens_generated_total",
        "onpolicy_trainer_tokens_per_second", "onpolicy_weight_version", "onpolicy_verification_lag_seconds",
        "onpolicy_job_loss", "onpolicy_job_grad_norm", "onpolicy_job_clip_fraction", "onpolicy_job_entropy",
        "onpolicy_job_eval_accuracy")}
    assert all(by_metric.values()), [m for m, ps in by_metric.items() if not ps]
    assert any(p["type"] == "heatmap" for p in by_metric["onpolicy_logdiff_bucket"])
    mismatch_rate = [p for p in by_metric["onpolicy_tokens_mismatched_total"] if p["type"] == "timeseries"]
    assert any("rate(onpolicy_tokens_mismatched_total" in t["expr"] for p in mismatch_rate for t in p["targets"])


# ---- live services ----------------------------------------------------------------------------------

def exposition_names(text: str) -> tuple[set[str], list[dict[str, str]]]:
    """Sample names a Prometheus text exposition can produce (from # TYPE lines, so families with no
    series yet count) and the label sets of its samples."""
    names: set[str] = set()
    labels: list[dict[str, str]] = []
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count"),
                "counter": ("", "_total")}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base + s for s in suffixes.get(kind, ("",))}
        elif line and not line.startswith("#"):
            m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s", line)
            assert m, line
            names.add(m.group(1))
            labels.append(dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or "")))
    return names, labels


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


@pytest.fixture(scope="module")
def live_role_metrics() -> Iterator[dict[str, str]]:
    """The verifier, rollout and trainer services started in-process (tiny-qwen3) with their
    /metrics endpoints, scraped over HTTP."""
    from onpolicy.kernels import KernelConfig
    from onpolicy.services.roles import ROLES, start_role

    started = []
    try:
        for role in ("verifier", "rollout", "trainer"):
            opts = ROLES[role].options(model="tiny-qwen3", kernels=KernelConfig(kv_tile=16), job="deploy-test")
            started.append((role, start_role(opts, metrics_host="127.0.0.1")))
        yield {role: scrape(rs.metrics.url) for role, rs in started}
    finally:
        for _, rs in started:
            rs.stop(grace=0)


def test_live_services_export_every_metric_the_dashboard_and_alerts_query(live_role_metrics) -> None:
    exported: set[str] = set()
    for role, text in live_role_metrics.items():
        names, samples = exposition_names(text)
        exported |= names
        assert samples, f"{role} exported no series"
        for labels in samples:  # the dashboard filters and groups by these
            assert {"job", "model", "role"} <= labels.keys(), (role, labels)
            assert labels["role"] == role and labels["job"] == "deploy-test"
    queried = queried_metrics()
    assert not CONTROLLER_METRICS & exported, "exported by a role service now: drop it from CONTROLLER_METRICS"
    missing = queried - exported - CONTROLLER_METRICS
    assert not missing, f"the dashboard or alerts query metrics no live service exports: {sorted(missing)}"
    for verifier_metric in ("onpolicy_logdiff_bucket", "onpolicy_logdiff_sum", "onpolicy_logdiff_count",
                            "onpolicy_logdiff_max", "onpolicy_tokens_checked_total",
                            "onpolicy_tokens_mismatched_total", "onpolicy_verification_lag_seconds"):
        assert verifier_metric in exposition_names(live_role_metrics["verifier"])[0], verifier_metric


def test_controller_endpoint_exports_the_controller_metrics(tmp_path) -> None:
    """The chart's contract: `onpolicy up --metrics-port P` serves one aggregated /metrics; the
    metrics that only the controller knows must be declared there."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "onpolicy.cli.main", "up", "--port", "0", "--metrics-port", "0",
                             "--state-dir", str(tmp_path / "state")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    url, lines = None, []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.match(r"metrics endpoint: (\S+)", line):
                url = m.group(1)
            if line.startswith("jobs endpoint:"):
                break
        assert url and lines[-1].startswith("jobs endpoint:"), "".join(lines)[-3000:]
        names, _ = exposition_names(scrape(url))
    finally:
        proc.send_signal(signal.SIGTERM)  # graceful: the embedded Ray goes down with the process
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
    assert names >= CONTROLLER_METRICS, sorted(CONTROLLER_METRICS - names)
