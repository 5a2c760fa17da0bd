"""With kernel windows switched on (one setting), a launch-bound process gets a CUDA Graph verdict.

Kernel windows are off by default: on the H200 (2026-12-03) a loop of tiny launches ran about 9 %
slower for the rest of the run once CUPTI's kernel activity had been on in the process
(docs/performance.md). With `sampler.kernel_window_ms: 50` and nothing else changed:
the real probe (over the fake CUPTI, which keeps kernel records only while the
probe has the kernel activity on) runs a launch-bound loop in a child process
connected over the real Unix socket; the daemon runs with the shipped defaults otherwise
(only its socket and HTTP port chosen here). The sampler's periodic kernel windows
must reach the probe, the kernels of a window must reach the advisor, and
/api/engines must give a verdict other than insufficient_data within a minute.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from gpufootprint.app import App
from gpufootprint.config import load_config

from tests.probe_process import finish_probe_child, start_probe_child

pytestmark = pytest.mark.integration


def test_launch_bound_process_gets_a_graph_verdict_within_a_minute_with_kernel_windows_on(tmp_path: Path) -> None:
    assert load_config(None, env={}).sampler.kernel_window_ms == 0  # off by default (the cost above)
    config = load_config(None, env={"GPUFOOTPRINT_SAMPLER__KERNEL_WINDOW_MS": "50"})
    assert config.sampler.kernel_window_ms == 50 and not config.probe.kernels  # windows, not always-on kernels
    sock = tmp_path / "probe.sock"
    app = App(config, socket_path=str(sock), listen="127.0.0.1:0")
    app.start()
    child = start_probe_child(sock, tmp_path, "alloc:0x10000:67108864", "launch_loop:15",
                              GPUFOOTPRINT_PROBE_FLUSH_MS="100", GPUFOOTPRINT_PROBE_HEARTBEAT_MS="1000")
    verdicts: list[dict[str, object]] = []
    started = time.monotonic()
    try:
        assert app.http is not None
        url = app.http.url.replace("/metrics", "/api/engines")
        while time.monotonic() - started < 60 and child.poll() is None:
            graph = json.loads(urllib.request.urlopen(url, timeout=10).read())["graph"]
            verdicts = [d for d in graph if d["pid"] == child.pid]
            if any(d["decision"] != "insufficient_data" for d in verdicts):
                break
            time.sleep(0.5)
        waited = time.monotonic() - started
        status = finish_probe_child(child)
    finally:
        if child.poll() is None:
            child.kill()
        app.stop()
    assert status["status"]["kernel_windows"] >= 1
    decided = [d for d in verdicts if d["decision"] != "insufficient_data"]
    assert decided, verdicts
    assert waited < 60
    d = decided[0]
    # 10 tiny kernels per step; the 64 MiB allocated before the loop and none since: a static footprint
    assert d["op_count"] == 10 and d["reuse_ratio"] == 1.0, d
    assert d["decision"] == "keep" and "fail: mean kernel duration 0.002 ms < 0.5 ms" in d["reasons"], d
