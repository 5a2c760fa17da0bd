"""CUDA Graph advice on long training steps, end to end: a default App (fake NVML), a child probe on
its socket that answers launch windows with the launch and wait calls of a 200 ms step, and the
verdict on /api/engines and /metrics.

The child is a probe as the daemon sees it: it records calls only while a launch window is open, as
long as the daemon last asked (the ``ms`` of each kernel_window CONTROL frame). A fixed 50 ms window
never holds a whole 200 ms step; a window that follows the step does, and NVML's per-process busy
samples give the mean kernel duration the lower bound the seed's policy (>= 0.5 ms) needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.configload import load_config

sys.path.insert(0, str(Path(__file__).parents[1]))
from nvml_fake import FakeNvml

pytestmark = pytest.mark.integration

# A training loop of 10 launches and a synchronize per 200 ms step, seen through a probe's launch windows.
CHILD = textwrap.dedent('''
    import json, os, socket, sys, time
    import numpy as np
    from gpufootprint.records import API_DTYPE, MEMORY_DTYPE, ApiRole, RecordKind
    from gpufootprint.wire.framing import PREAMBLE, FrameDecoder, FrameType, encode_batch, encode_json, encode_watermark
    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
    pid, run_s = os.getpid(), float(sys.argv[2])
    s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid, "start_time": 1, "launch_windows": 1}))
    r = np.zeros(1, MEMORY_DTYPE)
    r["ts"], r["op"], r["mk"], r["addr"], r["bytes"], r["pid"] = time.time_ns(), 1, 3, 0x1000, 1 << 30, pid
    s.sendall(encode_batch(RecordKind.MEMORY, r))
    s.setblocking(False)
    dec = FrameDecoder(); dec.feed(PREAMBLE)
    got, window_until, calls = [], 0.0, []
    end = time.monotonic() + run_s
    while time.monotonic() < end:
        t0 = time.time_ns()
        for i in range(10):  # ten launches of 20 us, back to back
            calls.append((ApiRole.LAUNCH, t0 + i * 20_000, t0 + i * 20_000 + 15_000))
        ws = t0 + 200_000
        time.sleep(0.2)  # the GPU runs the step
        calls.append((ApiRole.SYNC, ws, time.time_ns()))
        open_now = time.monotonic() < window_until
        if open_now and calls:
            a = np.zeros(len(calls), API_DTYPE)
            for j, (role, st, en) in enumerate(calls):
                a[j]["start"], a[j]["end"], a[j]["role"], a[j]["tid"], a[j]["pid"], a[j]["domain"] = st, en, role, 7, pid, 5
            s.sendall(encode_batch(RecordKind.API, a))
        calls = []
        s.sendall(encode_watermark(time.time_ns()))
        try:
            data = s.recv(65536)
        except BlockingIOError:
            data = b""
        for f in dec.feed(data):
            if f.type == FrameType.CONTROL:
                body = f.json(); got.append(body)
                if body.get("op") == "kernel_window":
                    window_until = time.monotonic() + body["ms"] / 1000
    print(json.dumps(got))
''')


def _get(port: int, path: str) -> Any:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read().decode()


def _run(tmp_path: Path, busy: float | None, seconds: float = 6.0) -> tuple[list[dict[str, Any]], dict[str, Any],
                                                                             str, dict[str, Any]]:
    from gpufootprint.app import App

    # the defaults, but the first periodic window 0.5 s in (not 5 s) so the test is short
    config = load_config(env={}, overrides={"daemon.tick_ms": 20, "sampler.kernel_window_first_seconds": 0.5,
                                            "exporter.listen": "127.0.0.1:0"})
    fake = FakeNvml("healthy", gpus=1)
    sock = str(tmp_path / "probe.sock")
    app = App(config, socket_path=sock, listen="127.0.0.1:0", nvml_client=fake)
    app.start()
    stop = threading.Event()
    child = subprocess.Popen([sys.executable, "-c", CHILD, sock, str(seconds)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)

    def driver() -> None:  # the driver's per-process samples, six a second, while the child runs
        while not stop.wait(1 / 6):
            if busy is not None:
                fake.add_busy(0, child.pid, time.time_ns() // 1000, busy)

    t = threading.Thread(target=driver, daemon=True)
    t.start()
    try:
        out, err = child.communicate(timeout=60)
        app.ingest.tick()
        assert app.http is not None and app.http.exposition is not None
        app.http.exposition.render()
        engines = json.loads(_get(app.http.port, "/api/engines"))
        metrics = _get(app.http.port, "/metrics")
        nvml = json.loads(_get(app.http.port, "/api/nvml"))
    finally:
        stop.set()
        app.stop()
    assert child.returncode == 0, err
    mine = [d for d in engines["graph"] if d["pid"] == child.pid]
    assert len(mine) == 1, engines["graph"]
    return json.loads(out), mine[0], metrics, nvml


def test_a_launch_window_follows_200ms_steps_and_nvml_busy_time_lets_the_default_policy_capture(
        tmp_path: Path) -> None:
    controls, d, metrics, nvml = _run(tmp_path, busy=0.95)
    windows = [c for c in controls if c["op"] == "kernel_window"]
    # THEN the first window was held open past 50 ms (2 s leases) and closed (1 ms) once it held 4 steps
    assert windows[0]["ms"] == 2000 and windows[0]["records"] == "launches", windows
    assert any(c["ms"] == 1 and c["id"] == windows[0]["id"] for c in windows), windows
    # AND the advisor read the steps between waits, and NVML's busy share bounded the mean kernel from below
    assert d["evidence"] == "launches" and d["op_count"] == 10 and d["steps"] >= 3, d
    assert d["gpu_busy_ratio"] == pytest.approx(0.95) and d["busy_samples"] >= 1, d
    # (0.95 - 0.2) of a ~200 ms step over 10 launches: about 15 ms, well above the policy's 0.5 ms
    assert 0.010 < d["mean_kernel_seconds_min"] <= d["mean_kernel_seconds_max"], d
    assert d["decision"] == "capture", d["reasons"]
    line = f'gpufootprint_graph_advice{{decision="capture",pid="{d["pid"]}",source="probe",stream=""}} 1.0'
    assert line in metrics, [ln for ln in metrics.splitlines() if "graph_advice" in ln]
    assert nvml["process_busy"]["0"][str(d["pid"])], nvml


def test_without_nvml_busy_samples_the_same_steps_stay_insufficient_data(tmp_path: Path) -> None:
    # the same loop, but the driver gives no per-process samples: the minimum can fail, never pass
    _, d, _, _ = _run(tmp_path, busy=None)
    assert d["evidence"] == "launches" and d["op_count"] == 10, d
    assert d["mean_kernel_seconds_min"] is None and d["decision"] == "insufficient_data", d
    assert any(r.startswith("unknown: mean kernel duration") for r in d["reasons"]), d["reasons"]
