"""A real Prometheus server scrapes the daemon replaying a real H200 trace; every
dashboard query, every template-variable query and every rule expression is then
evaluated through Prometheus' HTTP API, and /metrics passes `promtool check metrics`.

Prometheus and promtool come from Debian's `prometheus` package (.ci/run installs
it). Without them the test skips on a developer's machine and FAILS under CI=true.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "data" / "h200_caching.jsonl.gz"
DASHBOARD = ROOT / "deploy" / "grafana" / "gpufootprint.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"

# Metrics of issues not merged into this build yet. Queries naming one of them must
# still evaluate without error, but may return no data. The lead empties these at merge.
NOT_YET_MERGED = {
    # issue 3 (probe)
    "gpufootprint_probe_records_dropped_total", "gpufootprint_probe_callback_seconds_total",
    # issue 4 (sampler, frames, NVML)
    "gpufootprint_nvml_memory_used_bytes", "gpufootprint_page_migrations_total", "gpufootprint_page_faults_total",
    "gpufootprint_sampler_mode", "gpufootprint_anomaly_windows_total",
    # issue 5 (engines)
    "gpufootprint_graph_advice", "gpufootprint_graph_launch_overhead_seconds",
    "gpufootprint_budget_utilization_ratio", "gpufootprint_budget_exhaustion_seconds",
    "gpufootprint_leak_suspect_bytes", "gpufootprint_leak_suspect", "gpufootprint_cost_dollars_total",
    "gpufootprint_idle_gpu_seconds_total", "gpufootprint_idle_cost_dollars_total",
    "gpufootprint_unused_memory_cost_dollars_total", "gpufootprint_gpu_price_dollars_per_hour",
}

# Grafana's variables as a user with "All" selected would send them.
GRAFANA_VARS = {"$__rate_interval": "10s", "$__interval": "5s", "$__range": "1m", "$cluster": ".*",
                "$node": ".*", "$namespace": ".*", "$pod": ".*", "$gpu": ".*"}
METRIC = re.compile(r"\b(gpufootprint_[a-z0-9_]+|up)\b(?!\s*\()")


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        msg = f"{name} is missing: apt-get install -y prometheus"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


def _wait(what: str, check: Any, timeout: float, procs: dict[str, tuple[subprocess.Popen[bytes], Path]] | None = None
          ) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        for name, (proc, log) in (procs or {}).items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                                     f"{log.read_text()[-3000:]}")
        try:
            value = check()
            if value:
                return value
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what} ({last})")


class Prom:
    def __init__(self, base: str) -> None:
        self.base = base

    def api(self, path: str, **params: str) -> dict[str, Any]:
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = _get(url)
        except urllib.error.HTTPError as exc:  # 400/422: the body says why
            body = exc.read()
        return dict(json.loads(body))

    def instant(self, expr: str) -> dict[str, Any]:
        return self.api("query", query=expr)

    def range(self, expr: str, seconds: int = 20) -> dict[str, Any]:
        end = time.time()
        return self.api("query_range", query=expr, start=f"{end - seconds:.3f}", end=f"{end:.3f}", step="1")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prom, str]]:
    prometheus = _tool("prometheus")
    _tool("promtool")
    tmp = tmp_path_factory.mktemp("prom")
    dport, pport = _free_port(), _free_port()
    env = {**os.environ, "GPUFOOTPRINT_KUBERNETES__MODE": "sidecar", "POD_NAME": "trainer-0",
           "POD_NAMESPACE": "ml-team", "CONTAINER_NAME": "trainer"}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpufootprint", "replay", str(TRACE), "--listen", f"127.0.0.1:{dport}",
         "--speed", "1", "--linger", "60"], env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "daemon.log", "w"))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "gpufootprint", "static_configs": [
            {"targets": [f"127.0.0.1:{dport}"], "labels": {"cluster": "ci", "node": "local"}}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = subprocess.Popen(
        [prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{pport}"], stdout=subprocess.DEVNULL,
        stderr=open(tmp / "prometheus.log", "w"))
    try:
        prom = Prom(f"http://127.0.0.1:{pport}")
        metrics_url = f"http://127.0.0.1:{dport}/metrics"
        procs = {"gpufootprint": (daemon, tmp / "daemon.log"), "prometheus": (server, tmp / "prometheus.log")}
        _wait("the daemon's /metrics", lambda: b"gpufootprint_device_bytes" in _get(metrics_url), 60, procs)
        _wait("Prometheus to be ready", lambda: _get(f"{prom.base}/-/ready"), 60, procs)
        # 12 s of 1 s scrapes: the replay (4.2 s of real time) is over and 10 s rate windows are full.
        _wait("12 scraped samples", lambda: _samples(prom) >= 12, 90, procs)
        yield prom, metrics_url
    finally:
        for proc in (server, daemon):
            proc.send_signal(signal.SIGTERM)
        for proc in (server, daemon):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _samples(prom: Prom) -> int:
    r = prom.instant('count_over_time(gpufootprint_build_info{job="gpufootprint"}[1m])')
    res = r.get("data", {}).get("result", [])
    return int(float(res[0]["value"][1])) if res else 0


def _substitute(expr: str) -> str:
    for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def _metrics(expr: str) -> set[str]:
    return {m for m in METRIC.findall(expr) if ":" not in m}


def _panel_queries() -> list[tuple[str, str, bool]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"], bool(t.get("instant"))))
    for ann in dash["annotations"]["list"]:
        if "expr" in ann:
            out.append((f"annotation {ann['name']}", ann["expr"], False))
    return out


def _variable_queries() -> list[tuple[str, str]]:
    out = []
    for var in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert m, var["query"]
        out.append((var["name"], f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


def _rules() -> list[tuple[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(r.get("record") or r["alert"], r["expr"]) for g in doc["groups"] for r in g["rules"]]


def _assert_ok(result: dict[str, Any], what: str) -> list[Any]:
    assert result.get("status") == "success", f"{what}: {result.get('errorType')}: {result.get('error')}"
    return list(result["data"]["result"])


def test_every_dashboard_query_evaluates_and_returns_data(stack: tuple[Prom, str]) -> None:
    prom, _ = stack
    queries = _panel_queries()
    assert len(queries) >= 25
    empty = []
    for title, raw, instant in queries:
        expr = _substitute(raw)
        result = _assert_ok(prom.instant(expr) if instant else prom.range(expr), f"{title}: {expr}")
        if not result and not (_metrics(raw) & NOT_YET_MERGED):
            empty.append(f"{title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_every_template_variable_query_evaluates(stack: tuple[Prom, str]) -> None:
    prom, _ = stack
    got = {}
    for name, expr in _variable_queries():
        got[name] = _assert_ok(prom.instant(_substitute(expr)), f"variable {name}: {expr}")
    assert [r["metric"].get("cluster") for r in got["cluster"]] == ["ci"]
    assert [r["metric"].get("node") for r in got["node"]] == ["local"]
    assert [r["metric"].get("namespace") for r in got["namespace"]] == ["ml-team"]
    assert [r["metric"].get("pod") for r in got["pod"]] == ["trainer-0"]
    assert [r["metric"].get("gpu") for r in got["gpu"]] == ["0"]


def test_every_rule_expression_evaluates_and_its_metrics_have_data(stack: tuple[Prom, str]) -> None:
    prom, _ = stack
    missing = []
    for name, expr in _rules():
        result = _assert_ok(prom.instant(expr), f"rule {name}")
        if expr.lstrip().startswith("sum") and ">" not in expr and "<" not in expr and "==" not in expr:
            # A recording rule: its own result must have data.
            if not result and not (_metrics(expr) & NOT_YET_MERGED):
                missing.append(f"{name}: {expr}")
        # An alert condition is empty while healthy; the series it reads must not be.
        for metric in _metrics(expr) - NOT_YET_MERGED:
            if not _assert_ok(prom.instant(f'count({{__name__="{metric}"}})'), metric):
                missing.append(f"{name}: no series of {metric}")
    assert not missing, "\n".join(missing)


def test_prometheus_loaded_and_evaluated_every_rule_without_error(stack: tuple[Prom, str]) -> None:
    prom, _ = stack

    def evaluated() -> list[dict[str, Any]]:
        groups = _assert_ok({"status": "success", "data": {"result": prom.api("rules")["data"]["groups"]}}, "rules")
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("2") and
                                      not r["lastEvaluation"].startswith("0001") for r in rules) else []

    rules = _wait("every rule to be evaluated once", evaluated, 60)
    assert {r["name"] for r in rules} == {name for name, _ in _rules()}
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad
    firing = [r["name"] for r in rules if r["type"] == "alerting" and r["state"] != "inactive"]
    assert firing == []  # a healthy replay raises nothing (DaemonDown, SeriesCap, ...)


def test_scraped_series_carry_pod_labels_from_the_sidecar_environment(stack: tuple[Prom, str]) -> None:
    prom, _ = stack
    result = _assert_ok(prom.instant('gpufootprint_device_bytes{job="gpufootprint"}'), "device bytes")
    assert result
    for r in result:
        labels = r["metric"]
        assert (labels["pod"], labels["namespace"], labels["container"], labels["attribution"]) == (
            "trainer-0", "ml-team", "trainer", "sidecar")
    # The trace's 280 MiB of device memory (after the final empty_cache) reach Prometheus.
    assert float(result[0]["value"][1]) > 200 * 2**20


def test_promtool_check_metrics_reports_nothing(stack: tuple[Prom, str]) -> None:
    _, metrics_url = stack
    text = _get(metrics_url)
    assert b"gpufootprint_series_dropped_total" in text
    result = subprocess.run([_tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.decode().strip() == "" and result.stderr.decode().strip() == ""
