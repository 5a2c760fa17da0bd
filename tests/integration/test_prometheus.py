"""A real Prometheus server scrapes the daemon replaying recorded traces; every
dashboard query, every template-variable query and every rule expression is then
evaluated through Prometheus' HTTP API and must return data (NVML's series alone
excepted: they need a GPU), and /metrics passes `promtool check metrics`.

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

import numpy as np
import pytest
import yaml

# One worker runs this file's tests (pytest-xdist --dist loadgroup): its module fixture is built once.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("test_prometheus")]

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
DASHBOARD = ROOT / "deploy" / "grafana" / "gpufootprint.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
METRICS_DOC = ROOT / "docs" / "metrics.md"
# Budget rules, prices and cost.default_model (no NVML model on a CPU runner), sidecar mode.
CONFIG = Path(__file__).with_name("prometheus_replay.yaml")
UM_PID = 6161  # the synthetic unified-memory trace's process (_write_um_round_trip)

# Replayed one after another into one pipeline, at SPEED times real time. Between them
# every dashboard query and rule expression has data:
#   h200_caching.jsonl.gz        real H200, pid 855: the footprint by kind, copies, memsets
#   synth_leak.gfp.gz            20 min of a slow leak (pid 5151) beside a steady process (5252):
#                                leak suspicion; the budget on 5151 (CONFIG) a time to exhaustion
#   h200_probe_pinned_managed    real H200 probe recording, pid 615: HEARTBEAT/GOODBYE counters, unified memory
#                                (probe overhead and drops) and unified-memory GPU page faults
#   um_round_trip.gfp (tmp)      synthetic: unified-memory transfers in both directions, CPU and
#                                GPU faults, with a known answer; then an OOM (the OOM counter, its alert)
#   h200_kernels_train.gfp.gz    real H200 probe recording, pid 672: KERNEL records of a
#                                training step (graph advice, launch overhead); anomaly windows
#                                after Prometheus has started scraping (the annotation's increase)
TRACES: list[str | None] = ["h200_caching.jsonl.gz", "synth_leak.gfp.gz", "h200_probe_pinned_managed.gfp.gz",
                            None, "h200_kernels_train.gfp.gz"]
LAST_PID = 672  # the last trace's process: in /metrics once the replay is over
SPEED = 200.0  # synth_leak's 1200 s of trace time in 6 s

# The only exemption from "returns data": NVML's series exist only where the daemon finds
# an NVIDIA driver and a GPU (docs/metrics.md, NVML's section); a replay has neither. Their
# queries must still evaluate without error; test_demo_prometheus.py checks them with data
# against the demo's simulated H200.
NO_DATA_WITHOUT_GPU = {
    "gpufootprint_nvml_memory_used_bytes",  # "Window peak vs NVML used memory", NVML's line
    "gpufootprint_nvml_memory_total_bytes",  # GpuFootprintGpuMemoryNearlyFull (with the line above)
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


def _write_um_round_trip(path: Path) -> None:
    """A 64 MiB managed buffer touched by the CPU, then the GPU, four times: what CUPTI's
    UNIFIED_MEMORY_COUNTER reports for it (2 MiB transfers each way, CPU and GPU faults).
    Synthetic, like synth_leak, so the Prometheus round trip has a known answer; the real H200
    recording (h200_probe_pinned_managed) is checked in tests/integration/test_probe_traces.py."""
    from gpufootprint.features.frames import UmCounterKind
    from gpufootprint.records import DTYPES, RecordKind
    from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json, encode_watermark

    t0, chunk, chunks, base = 1_796_214_200_000_000_000, 2 << 20, 32, 0x7F00_0000_0000
    # Per touch (every 50 ms, CPU and GPU in turn): a fault then a 2 MiB transfer per chunk.
    touches = [(UmCounterKind.CPU_PAGE_FAULT_COUNT, UmCounterKind.BYTES_TRANSFER_DTOH),
               (UmCounterKind.GPU_PAGE_FAULT, UmCounterKind.BYTES_TRANSFER_HTOD)] * 4
    recs = np.zeros(len(touches) * chunks * 2, dtype=DTYPES[RecordKind.UNIFIED_MEMORY])
    j = 0
    for n, (fault, transfer) in enumerate(touches):
        for i in range(chunks):
            ts = t0 + n * 50_000_000 + i * 100_000
            for start, end, value, ck in ((ts, ts + 20_000, 1, fault), (ts + 20_000, ts + 90_000, chunk, transfer)):
                recs[j]["start"], recs[j]["end"], recs[j]["value"], recs[j]["ck"] = start, end, value, ck
                recs[j]["addr"] = base + i * chunk
                j += 1
    recs["pid"], recs["dev"] = UM_PID, 0
    body = PREAMBLE + encode_json(FrameType.META, {"pid": UM_PID, "format": "synthetic", "scenario": "um_round_trip"})
    body += b"".join(encode_batch(RecordKind.UNIFIED_MEMORY, recs[i:i + 64]) for i in range(0, len(recs), 64))
    # Then an allocation fails (the probe's `oom` MARK): the OOM counter and its alert (docs/oom.md).
    oom_ts = int(recs["end"].max()) + 1
    body += encode_json(FrameType.MARK, {"label": "oom", "ts": oom_ts, "pid": UM_PID, "dev": 0,
                                         "oom": {"source": "cupti", "api": "cuMemAlloc_v2", "failed_calls": 1,
                                                 "requested_bytes": None, "dev_known": False}})
    # As a probe would end it: a watermark, then its live table's totals as of it (none here), which the
    # daemon checks its footprint against (gpufootprint_footprint_drift_bytes).
    wm = oom_ts + 1
    path.write_bytes(body + encode_watermark(wm) + encode_json(FrameType.TOTALS, {"ts": wm, "pid": UM_PID,
                                                                                  "devices": {}}))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prom, str]]:
    prometheus = _tool("prometheus")
    _tool("promtool")
    tmp = tmp_path_factory.mktemp("prom")
    um = tmp / "um_round_trip.gfp"
    _write_um_round_trip(um)
    traces = [str(DATA / name) if name else str(um) for name in TRACES]
    dport, pport = _free_port(), _free_port()
    env = {**os.environ, "POD_NAME": "trainer-0", "POD_NAMESPACE": "ml-team", "CONTAINER_NAME": "trainer"}
    # Prometheus first, so that it scrapes from the daemon's start: counters that rise
    # during the replay (anomaly windows) then have an increase() to show.
    server = start_prometheus(prometheus, tmp, pport, dport, cluster="ci")
    daemon: subprocess.Popen[bytes] | None = None
    try:
        prom = Prom(f"http://127.0.0.1:{pport}")
        _wait("Prometheus to be ready", lambda: _get(f"{prom.base}/-/ready"), 60,
              {"prometheus": (server, tmp / "prometheus.log")})
        daemon = subprocess.Popen(
            [sys.executable, "-m", "gpufootprint", "replay", *traces, "--config", str(CONFIG),
             "--listen", f"127.0.0.1:{dport}", "--speed", str(SPEED), "--linger", "90"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "daemon.log", "w"))  # noqa: SIM115 - the daemon's log, for its life
        metrics_url = f"http://127.0.0.1:{dport}/metrics"
        procs = {"gpufootprint": (daemon, tmp / "daemon.log"), "prometheus": (server, tmp / "prometheus.log")}
        _wait("the replay to reach its last trace",
              lambda: f'pid="{LAST_PID}"'.encode() in _get(metrics_url), 90, procs)
        # 12 more 1 s scrapes once the last trace is in: the engines have judged it, and every
        # 10 s rate window holds several samples.
        after = _samples(prom) + 12
        _wait(f"{after} scraped samples", lambda: _samples(prom) >= after, 90, procs)
        yield prom, metrics_url
    finally:
        stop_processes(server, daemon)


def start_prometheus(prometheus: str, tmp: Path, port: int, target_port: int, *, cluster: str) -> subprocess.Popen[bytes]:
    """A real Prometheus on ``port``, scraping gpufootprint on ``target_port`` every second with
    the shipped rules, its log in ``tmp/prometheus.log``."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "gpufootprint", "static_configs": [
            {"targets": [f"127.0.0.1:{target_port}"], "labels": {"cluster": cluster, "node": "local"}}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    return subprocess.Popen(
        [prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
        stderr=open(tmp / "prometheus.log", "w"))


def stop_processes(*procs: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM to each, then up to 15 s each to exit before it is killed."""
    for proc in procs:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        if proc is None:
            continue
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _samples(prom: Prom) -> int:
    r = prom.instant('count_over_time(gpufootprint_build_info{job="gpufootprint"}[10m])')
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


def _rules() -> list[tuple[str, str, str]]:
    """(name, "record" or "alert", expr) of every rule."""
    doc = yaml.safe_load(RULES.read_text())
    return [(r.get("record") or r["alert"], "record" if "record" in r else "alert", r["expr"])
            for g in doc["groups"] for r in g["rules"]]


# Alerts the replay is built to raise, with the labels that single out their series. The first
# two hold pending (their `for` is minutes long); every other alert must stay inactive.
EXPECTED_ALERTS = {
    "GpuFootprintLeakSuspected": {"pid": "5151"},  # synth_leak's leaking process
    "GpuFootprintBudgetExhaustionSoon": {"scope": "process", "name": "5151"},  # its 2 GiB budget (CONFIG)
    "GpuFootprintOutOfMemory": {"pid": str(UM_PID), "pod": "trainer-0"},  # um_round_trip's failed allocation
}
FIRING_AT_ONCE = {"GpuFootprintOutOfMemory"}  # no `for:`: an OOM has happened, nothing to wait for


def _assert_ok(result: dict[str, Any], what: str) -> list[Any]:
    assert result.get("status") == "success", f"{what}: {result.get('errorType')}: {result.get('error')}"
    return list(result["data"]["result"])


def _exempt(raw: str) -> bool:
    """A query may be empty only when every metric it names needs a GPU."""
    names = _metrics(raw)
    return bool(names) and names <= NO_DATA_WITHOUT_GPU


def test_every_dashboard_query_evaluates_and_returns_data(stack: tuple[Prom, str]) -> None:
    prom, _ = stack
    queries = _panel_queries()
    assert len(queries) >= 25
    empty, exempt = [], []
    for title, raw, instant in queries:
        expr = _substitute(raw)
        result = _assert_ok(prom.instant(expr) if instant else prom.range(expr), f"{title}: {expr}")
        if _exempt(raw):
            exempt.append(title)
        elif not result:
            empty.append(f"{title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert exempt == ["Window peak vs NVML used memory"]  # 1 of the 26 queries: NVML's line


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
    for name, kind, expr in _rules():
        result = _assert_ok(prom.instant(expr), f"rule {name}")
        if kind == "record" and not result:
            missing.append(f"{name}: {expr}")
        if name in EXPECTED_ALERTS:
            # The condition itself holds for exactly the series the replay is built to flag.
            want = EXPECTED_ALERTS[name]
            got = [{k: r["metric"].get(k) for k in want} for r in result]
            if got != [want]:
                missing.append(f"{name}: {expr} gave {got}, expected [{want}]")
        # Any other alert condition is empty on a healthy replay; the series it reads must not be.
        for metric in _metrics(expr):
            if metric in NO_DATA_WITHOUT_GPU:
                continue  # an NVML rule (memory nearly full): its series are checked against the demo's
                # simulated H200 in test_demo_prometheus.py
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
    assert {r["name"] for r in rules} == {name for name, _, _ in _rules()}
    assert len(rules) == len(_rules())
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad
    active = {r["name"]: r for r in rules if r["type"] == "alerting" and r["state"] != "inactive"}
    # DaemonDown, DaemonAbsent, ProbeDroppingRecords, CuptiLostRecords, IdleExpensiveGpu, SeriesCapReached,
    # PodCostHigh, IdleGpuHoursHigh, GpuMemoryNearlyFull: inactive.
    assert set(active) == set(EXPECTED_ALERTS)
    for name, rule in active.items():
        # `for:` is minutes; the test lasts seconds
        assert rule["state"] == ("firing" if name in FIRING_AT_ONCE else "pending"), (name, rule["state"])
        assert [{k: a["labels"].get(k) for k in EXPECTED_ALERTS[name]} for a in rule["alerts"]] == [
            EXPECTED_ALERTS[name]]


def test_scraped_series_carry_pod_labels_from_the_sidecar_environment(stack: tuple[Prom, str]) -> None:
    prom, _ = stack
    result = _assert_ok(prom.instant('gpufootprint_device_bytes{job="gpufootprint"}'), "device bytes")
    # One series per replayed process (of every trace, the synthetic UM one included).
    assert sorted(int(r["metric"]["pid"]) for r in result) == sorted([615, 672, 855, 5151, 5252, UM_PID])
    for r in result:
        labels = r["metric"]
        assert (labels["pod"], labels["namespace"], labels["container"], labels["attribution"]) == (
            "trainer-0", "ml-team", "trainer", "sidecar")
    # The caching trace's 280 MiB of device memory (after the final empty_cache) reach Prometheus.
    caching = next(r for r in result if r["metric"]["pid"] == "855")
    assert float(caching["value"][1]) > 200 * 2**20


def test_api_processes_and_oom_carry_the_engines_and_the_replayed_oom(stack: tuple[Prom, str]) -> None:
    """What ``top`` reads, from the same daemon: the leak engine's flag, the CUDA Graph advisor's verdict,
    pod names from the sidecar environment, and the replayed OOM (counted, listed, not captured again)."""
    _, metrics_url = stack
    base = metrics_url[: -len("/metrics")]
    doc = json.loads(_get(f"{base}/api/processes"))
    rows = {r["pid"]: r for r in doc["processes"]}
    assert rows[5151]["leak_suspect"] is True and rows[5252]["leak_suspect"] is False
    # The leak engine's reasons on /api/engines: the growing process judged on its floors, the steady one
    # on its slope alone (under the threshold its floors are not walked)
    leaks = {r["pid"]: r for r in json.loads(_get(f"{base}/api/engines"))["leaks"]}
    assert leaks[5151]["suspect"] and "segments" in leaks[5151]["reasons"][0], leaks[5151]["reasons"]
    assert re.fullmatch(r"fail: footprint grows -?\d+ B/s \(threshold 1024 B/s\)", leaks[5252]["reasons"][0]), \
        leaks[5252]["reasons"]
    assert rows[672]["graph_verdict"] is not None
    assert {r["pod"] for r in rows.values()} == {"trainer-0"}
    assert rows[UM_PID]["oom_events"] == 1 and all(r["oom_events"] == 0 for p, r in rows.items() if p != UM_PID)
    (event,) = json.loads(_get(f"{base}/api/oom"))
    assert (event["pid"], event["source"], event["capture"]) == (UM_PID, "trace", None)
    assert event["pod"] == {"namespace": "ml-team", "pod": "trainer-0", "container": "trainer"}


def _documented() -> set[str]:
    return set(re.findall(r"`(gpufootprint_[a-z0-9_]+)`", METRICS_DOC.read_text()))


def _declared(text: bytes) -> set[str]:
    """Families /metrics declares (`# TYPE name type`), with samples or not (no ingest error yet)."""
    return {line.split()[2] for line in text.decode().splitlines() if line.startswith("# TYPE ")}


def test_every_metric_the_dashboard_and_rules_name_is_documented_and_exported(stack: tuple[Prom, str]) -> None:
    _, metrics_url = stack
    dash = json.loads(DASHBOARD.read_text())
    exprs = [raw for _, raw, _ in _panel_queries()]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    exprs += [expr for _, _, expr in _rules()]
    named = set().union(*(_metrics(e) for e in exprs)) - {"up"}
    assert len(named) >= 25
    undocumented = named - _documented()
    assert not undocumented, f"not in docs/metrics.md: {sorted(undocumented)}"
    declared = _declared(_get(metrics_url))
    assert sorted(named - declared) == sorted(NO_DATA_WITHOUT_GPU - declared)
    # The exemption names only NVML series the dashboard really uses.
    assert NO_DATA_WITHOUT_GPU <= named
    assert all(m.startswith("gpufootprint_nvml_") for m in NO_DATA_WITHOUT_GPU)


def test_promtool_check_metrics_reports_nothing(stack: tuple[Prom, str]) -> None:
    _, metrics_url = stack
    text = _get(metrics_url)
    assert b"gpufootprint_series_dropped_total" in text
    result = subprocess.run([_tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.decode().strip() == "" and result.stderr.decode().strip() == ""
