"""The engines run in the daemon's tick: a real probe-like child process over the
real Unix socket receives the budget's CONTROL frame, and /metrics shows the
decisions."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from gpufootprint.app import App
from gpufootprint.configload import load_config

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent


def test_budget_action_reaches_the_probe_and_engine_metrics_are_served(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("daemon: {tick_ms: 50}\n"
                        "budgets:\n  rules:\n    - {scope: process, name: '*', bytes: 1048576, soft_action: true}\n"
                        "sampler: {control: false}\n")  # only the budget's CONTROL frames here
    config = load_config(cfg_file, env={})
    sock = str(tmp_path / "probe.sock")
    app = App(config, socket_path=sock, listen="127.0.0.1:0")
    app.start()
    try:
        child = subprocess.run([sys.executable, str(HERE / "fake_probe.py"), sock, "2", str(4 << 20)],
                               capture_output=True, text=True, timeout=60, check=False)
        assert child.returncode == 0, child.stderr
        controls = [json.loads(line) for line in child.stdout.splitlines()]
        # a probe is asked for its table totals at its first watermark (self-verification) and told that
        # the daemon reads CUPTI buffers (level 1: this probe's HELLO names no level, as an older
        # probe's does); then the budget's action
        assert controls == [{"op": "verify", "cupti_buffers": 1}, {"op": "torch_empty_cache"}]
        deadline = time.monotonic() + 5
        while True:
            assert app.http is not None
            text = urllib.request.urlopen(app.http.url, timeout=5).read().decode()
            if "gpufootprint_graph_advice{" in text or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        report = json.loads(urllib.request.urlopen(app.http.url.replace("/metrics", "/api/engines"),
                                                   timeout=5).read())
    finally:
        app.stop()
    engine_lines = [line for line in text.splitlines() if line.startswith(('gpufootprint_budget', 'gpufootprint_graph'))]
    (decision,) = report["graph"]
    assert decision["decision"] == "capture" and decision["op_count"] == 12
    # the sampler's reuse feature reaches the advisor: one device allocation before the kernels and
    # none since is a static footprint
    assert decision["reasons"][2] == "pass: allocation reuse 1.00 >= 0.7"
    assert report["budget_actions_total"][0]["count"] == 1
    pid = next(line.split('pid="')[1].split('"')[0] for line in engine_lines if 'pid="' in line)
    assert (f'gpufootprint_budget_actions_total{{action="torch_empty_cache",name="{pid}",scope="process"}} 1.0'
            in engine_lines)
    # 12 kernels/step of 0.8 ms with 0.2 ms gaps; a static footprint
    assert f'gpufootprint_graph_advice{{decision="capture",pid="{pid}",source="probe",stream="7"}} 1.0' in engine_lines
    assert f'gpufootprint_graph_launch_overhead_seconds{{pid="{pid}",source="probe",stream="7"}} 0.002376' in engine_lines
