"""PyTorch's allocator figures reach the daemon from a real training loop, while it runs (marker gpu).

The probe reads ``allocated`` and ``reserved`` after optimizer steps, on the workload's own thread,
through PyTorch's global optimizer step hook (probe/torchnumbers.py). On a real torch the hook's
module is ``sys.modules["torch.optim.optimizer"]``, not an attribute of ``torch.optim`` (its
``__init__`` ends with ``del optimizer``): until 2026-12-06 the probe looked for the attribute and never
registered, so ``gpufootprint_allocator_slack_bytes`` had no series for any real process.

The reading is opt-in (``probe.torch_numbers``, off by default: docs/probe.md says why). A child probed
with it trains a small model with AdamW, then holds still; the daemon's /metrics must show
its ``reserved - allocated`` at each of two states, read while the child is still alive, and its
heartbeat must count the readings. What was seen goes to ``$OUT/torch_figures.json`` when OUT is set.
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

from gpufootprint.app import App
from gpufootprint.configload import load_config
from gpufootprint.launcher import probe_env

CHILD = r'''
import json, os, sys, time
import torch

model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(256, 2048, device="cuda")
held = []

def steps(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(0.05)
    torch.cuda.synchronize()
    time.sleep(1.2)  # past the probe's reading interval (a heartbeat): the next step's hook reads
    opt.step()  # no gradients: changes nothing, and its post hook reads the figures that now hold
    print(json.dumps({"pid": os.getpid(), "allocated": torch.cuda.memory_allocated(),
                      "reserved": torch.cuda.memory_reserved()}), flush=True)

steps(2.0)
sys.stdin.readline()
held.append(torch.empty(300 << 20, dtype=torch.uint8, device="cuda"))  # 300 MiB more, held
del held[0]  # and freed again: reserved stays, allocated falls back (the slack grows)
steps(1.0)
sys.stdin.readline()
'''


def _slack(text: str, pid: int) -> float | None:
    for line in text.splitlines():
        m = re.match(r"^gpufootprint_allocator_slack_bytes\{(.*)\} (\S+)$", line)
        if m and f'pid="{pid}"' in m.group(1):
            return float(m.group(2))
    return None


def test_a_training_loops_allocator_slack_reaches_metrics_while_it_runs(tmp_path: Path) -> None:
    sock = str(tmp_path / "probe.sock")
    app = App(load_config(env={}, overrides={"daemon.tick_ms": 50}), socket_path=sock, listen="127.0.0.1:0")
    app.start()
    seen: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "states": []}
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=probe_env(sock, GPUFOOTPRINT_PROBE_TORCH_NUMBERS="1"),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdin is not None and child.stdout is not None and app.http is not None
        for state in range(2):
            line = child.stdout.readline()
            assert line, f"child failed: {child.stderr.read()[-2000:] if child.stderr else ''}"
            figures = json.loads(line)
            want = figures["reserved"] - figures["allocated"]
            got = None
            deadline = time.monotonic() + 15  # a heartbeat (1 s), a tick, a /metrics render (1 s)
            while time.monotonic() < deadline:
                text = urllib.request.urlopen(f"http://127.0.0.1:{app.http.port}/metrics", timeout=5).read().decode()
                got = _slack(text, figures["pid"])
                if got == want:
                    break
                time.sleep(0.25)
            proc = next(p for p in app.ingest.snapshot.processes if p.pid == figures["pid"])
            seen["states"].append({"child": figures, "want_slack": want, "metric_slack": got,
                                   "torch_readings": proc.probe_counters.get("torch_readings"),
                                   "torch_read_seconds": proc.probe_counters.get("torch_read_seconds")})
            assert child.poll() is None  # the live view, not the exit's
            assert got == want, seen
            assert proc.probe_counters.get("torch_readings", 0) >= 1
            child.stdin.write("\n")
            child.stdin.flush()
        assert seen["states"][1]["want_slack"] >= seen["states"][0]["want_slack"] + (300 << 20)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
        app.stop()
        out = os.environ.get("OUT")
        if out:
            Path(out, "torch_figures.json").write_text(json.dumps(seen, indent=1))
