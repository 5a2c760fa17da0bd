"""The real NVML source next to a real PyTorch process on the GPU (marker gpu).

Self-contained: an App with the real pynvml client, the probe socket and HTTP,
and one child that allocates 256 MiB with PyTorch and waits. When the probe
package is present (``gpufootprint.probe``), the child runs probed, so NVML's
per-process memory and the probe's footprint are exported side by side; the
difference is the CUDA context and libraries (docs/metrics.md). What was seen is
written to ``$OUT/nvml_live.json`` when OUT is set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.app import App
from gpufootprint.configload import load_config
from gpufootprint.nvml.pynvml_client import PynvmlClient

# tests/gpu/conftest.py marks this file `gpu` and skips it where NVML, a GPU, cupti-python or torch is missing.

CHILD = r'''
import json, sys, time
import torch
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print(json.dumps({"pid": __import__("os").getpid(), "reserved": torch.cuda.memory_reserved(),
                  "allocated": torch.cuda.memory_allocated(), "torch": torch.__version__}), flush=True)
sys.stdin.readline()
'''


def metric_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out.append((labels, float(m.group(2))))
    return out


def test_real_nvml_next_to_a_torch_process(tmp_path: Path) -> None:
    t_start = time.monotonic()
    seen: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    sock = str(tmp_path / "probe.sock")
    config = load_config(env={}, overrides={"daemon.tick_ms": 50, "nvml.max_poll_ms": 200})
    app = App(config, socket_path=sock, listen="127.0.0.1:0", nvml_client=PynvmlClient())
    app.start()
    env = dict(os.environ)
    try:
        from gpufootprint.launcher import probe_env

        env = probe_env(sock, GPUFOOTPRINT_PROBE_FLUSH_MS="50")
        seen["probe_importable"] = True
    except ImportError:
        seen["probe_importable"] = False  # no probe package on this branch: the child runs unprobed
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        if not line:
            pytest.fail(f"torch child failed: {child.stderr.read()[-2000:] if child.stderr else ''}")
        info = json.loads(line)
        seen["child"] = info
        pid = info["pid"]
        used: int | None = None
        text = ""
        t_child = time.monotonic()
        while time.monotonic() < t_child + 20:  # NVML's process list and the probe's records need a moment
            time.sleep(0.5)
            nv = app.ingest.snapshot.nvml
            procs = {p: u for g in (nv.gpus if nv else ()) for p, u in g.processes.items()}
            used = procs.get(pid)
            proc = next((p for p in app.ingest.snapshot.processes if p.pid == pid), None)
            probe_done = proc is not None and bool(proc.devices) and proc.devices[0].device_bytes >= info["reserved"]
            # Without a probe (none importable, or none connected after 8 s), NVML alone is enough.
            if used is not None and (probe_done or not seen["probe_importable"] or time.monotonic() > t_child + 8):
                break
        seen["probed"] = any(p.pid == pid and p.source == "probe" for p in app.ingest.snapshot.processes)
        assert app.http is not None
        # /metrics bodies are rendered ahead, every exporter.render_interval_ms (1 s): scrape again, as
        # Prometheus would, until the body is from after the probe's footprint arrived.
        t_scrape = time.monotonic()
        while True:
            text = urllib.request.urlopen(f"http://127.0.0.1:{app.http.port}/metrics", timeout=5).read().decode()
            if not seen["probed"] or f'pid="{pid}"' in "".join(
                    line for line in text.splitlines() if line.startswith("gpufootprint_device_bytes{")):
                break
            if time.monotonic() > t_scrape + 5:
                break
            time.sleep(0.25)
        nv = app.ingest.snapshot.nvml
        assert nv is not None
        seen["nvml"] = {"state": nv.state, "detail": nv.detail, "driver": nv.driver_version, "errors": nv.errors,
                        "poll_interval_s": nv.poll_interval_s,
                        "gpus": [{"index": g.index, "model": g.model, "up": g.up, "state": g.state,
                                  "memory_total": g.memory_total_bytes, "memory_used": g.memory_used_bytes,
                                  "memory_reserved": g.memory_reserved_bytes, "util": g.utilization_ratio,
                                  "pcie_tx": g.pcie_tx_bytes_per_second, "pcie_rx": g.pcie_rx_bytes_per_second,
                                  "power_w": g.power_watts, "energy_j": g.energy_joules,
                                  "supported": g.field_supported, "processes": g.processes} for g in nv.gpus]}
        seen["nvml_process_used_bytes"] = used
        seen["metrics"] = {n: metric_values(text, n) for n in (
            "gpufootprint_nvml_process_used_bytes", "gpufootprint_device_bytes", "gpufootprint_live_bytes",
            "gpufootprint_allocator_slack_bytes", "gpufootprint_sampler_interval_seconds",
            "gpufootprint_nvml_memory_reserved_bytes", "gpufootprint_nvml_field_supported")}
        proc = next((p for p in app.ingest.snapshot.processes if p.pid == pid), None)
        if proc is not None and proc.devices:
            seen["probe_device_bytes"] = proc.devices[0].device_bytes
            seen["probe_live_bytes"] = proc.devices[0].live_bytes
            if used is not None:
                seen["nvml_minus_probe_bytes"] = used - proc.devices[0].device_bytes
    finally:
        if child.stdin:
            try:
                child.stdin.write("\n")
                child.stdin.flush()
            except OSError:
                pass
        child.wait(timeout=30)
        app.stop()
        seen["seconds"] = time.monotonic() - t_start
        out = os.environ.get("OUT")
        if out:
            Path(out, "nvml_live.json").write_text(json.dumps(seen, indent=1, default=str))

    # THEN NVML answered with the v2 memory call and saw the child by its (host) pid
    assert nv.state == "ok" and nv.gpus and all(g.up for g in nv.gpus), seen["nvml"]
    assert nv.gpus[0].memory_total_bytes and nv.gpus[0].memory_reserved_bytes is not None
    assert used is not None, (f"NVML did not list pid {pid} with its memory: pids are host pids; in a container "
                              f"the daemon needs the host pid namespace (hostPID). NVML saw {seen['nvml']['gpus']}")
    assert used >= info["reserved"], "NVML's per-process memory includes the context: never below torch's reserved"
    src = "probe" if seen["probed"] else "nvml"
    assert any(lab["pid"] == str(pid) and lab["source"] == src and v == used
               for lab, v in seen["metrics"]["gpufootprint_nvml_process_used_bytes"])
    if seen["probed"]:
        # ... and the probe's exact footprint of the same process is exported beside it
        assert seen.get("probe_device_bytes", 0) >= info["reserved"]
        assert any(lab["pid"] == str(pid) for lab, _ in seen["metrics"]["gpufootprint_device_bytes"])
