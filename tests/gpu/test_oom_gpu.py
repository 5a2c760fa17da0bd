"""OOM capture on a real GPU: a PyTorch and a CuPy process run out of memory under the daemon.

Each must leave exactly one capture whose footprint equals the framework's own figure at the
failure (PyTorch's ``memory_reserved()``, CuPy's pool ``total_bytes()``, read right after the
framework raised), and a capture that replays to that footprint. The daemon is the real ``App``
(socket, pipeline, OOM manager, HTTP) in this process; the workload is a child started with the
probe the way ``gpufootprint run`` starts it. Results go to ``$GPUFOOTPRINT_GPU_OUT/oom_*.json``
when it is set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.app import App
from gpufootprint.configload import load_config
from gpufootprint.launcher import probe_env
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file

WORKLOAD = str(Path(__file__).with_name("oom_workload.py"))
OUT = os.environ.get("GPUFOOTPRINT_GPU_OUT")


def _run(framework: str, tmp_path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], App]:
    config = load_config(env={})
    config = dataclasses.replace(config, oom=dataclasses.replace(config.oom, directory=str(tmp_path / "oom")))
    sock = str(tmp_path / "probe.sock")
    app = App(config, socket_path=sock, listen="127.0.0.1:0")
    app.start()
    try:
        env = probe_env(sock)
        child = subprocess.run([sys.executable, WORKLOAD, framework], env=env, capture_output=True, text=True,
                               timeout=300, check=False)
        assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-3000:]
        figures = json.loads(child.stdout.strip().splitlines()[-1])
        deadline = time.monotonic() + 30
        events: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            events = [e for e in app.oom.api() if e.get("report") or e.get("capture") is None]
            if events and app.oom.wait_idle(1):
                time.sleep(config.oom.coalesce_seconds + 1)  # nothing more may come
                events = app.oom.api()
                break
            time.sleep(0.2)
        port = app.http.port if app.http else 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        figures["metrics_oom_lines"] = [ln for ln in metrics.splitlines() if ln.startswith("gpufootprint_oom_events_total")]
    finally:
        app.stop()
    figures["events"] = events
    if OUT:
        Path(OUT, f"oom_{framework}.json").write_text(json.dumps(figures, indent=1))
    return figures, events, app


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_one_capture_per_oom_with_the_frameworks_own_footprint(framework: str, tmp_path: Path) -> None:
    if framework == "cupy":
        pytest.importorskip("cupy")
    figures, events, app = _run(framework, tmp_path)
    assert figures["probe_started"], figures
    assert len(events) == 1, events
    (event,) = events
    captures = [d for d in (tmp_path / "oom").iterdir() if d.is_dir()]
    assert len(captures) == 1 and (captures[0] / "capture.gfp.gz").exists() and (captures[0] / "report.html").exists()
    # the framework's own figure, read right after it raised: every byte it holds is a CUDA allocation
    assert event["live_bytes"].get("device") == figures["reserved"], (event, figures)
    # CUPTI's RUNTIME records saw the failed cudaMalloc of either framework (the driver call inside
    # it writes no DRIVER record: tests/gpu/cupti_modes_diag.py)
    assert "cupti" in event["seen_by"] and event["failed_calls"] >= 1, event
    if framework == "torch":
        assert "torch" in event["seen_by"] and event["requested_bytes"] == 1 << 30
        assert event["torch"]["torch_reserved_bytes"] == figures["reserved"]
    assert len(figures["metrics_oom_lines"]) == 1 and figures["metrics_oom_lines"][0].endswith(" 1.0")
    pipeline = Pipeline(app.config.footprint)
    result = replay_file(captures[0] / "capture.gfp.gz", pipeline)
    assert result.problems == [] and [m["matches"] for m in result.marks] == [True]
