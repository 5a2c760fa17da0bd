"""An OOM as a user meets it: a probed process (fake CUPTI at the edge) fails its allocations under
a real daemon; the event is in /metrics, /api/oom, /api/processes and ``top``, and the capture
opens in ``report`` and ``export``. Real processes, a real Unix socket, real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cli_env
from tests.integration.test_daemon import _free_port, _scrape, _wait
from tests.probe_process import finish_probe_child, start_probe_child

pytestmark = pytest.mark.integration

MiB = 1 << 20


@pytest.fixture
def daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    port = _free_port()
    sock = tmp_path / "probe.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufootprint", "daemon", "--socket", str(sock), "--listen", f"127.0.0.1:{port}",
         "--set", "footprint.reorder_window_ms=0", "--set", f"oom.directory={tmp_path / 'oom'}",
         "--set", "oom.coalesce_seconds=0.5"],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: sock.exists() and _scrape(port) is not None)
        yield proc, port, sock
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufootprint", *args], env=cli_env(), capture_output=True,
                          text=True, timeout=120)


def test_a_driver_level_oom_is_counted_logged_captured_and_shown(daemon: Any, tmp_path: Path) -> None:
    proc, port, sock = daemon
    # GIVEN a process holding 3 MiB that then fails cuMemAlloc_v2 twice (a framework's retry)
    child = start_probe_child(sock, tmp_path, "sleep:1.0", "alloc:0x1000:2097152", "alloc:0x400000:1048576",
                              "sleep:0.2", "apicall:243:2", "apicall:243:2", "sleep:1.5")
    status = finish_probe_child(child)
    pid = child.pid
    assert status["status"]["started"]
    # the daemon reads CUPTI's buffers itself (they are forwarded unread): the probe still saw the failures
    assert status["status"]["forwarded_buffers"] > 0 and status["status"]["oom_failed_calls"] == 2
    # THEN one event in /metrics, for that pid
    events = _wait(lambda: [v for labels, v in _scrape(port).get("gpufootprint_oom_events_total", [])
                            if labels["pid"] == str(pid)], timeout=20)
    assert events == [1.0]
    # AND /api/oom lists its capture, with the footprint at the failure
    (event,) = _wait(lambda: [e for e in _get(port, "/api/oom") if e["pid"] == pid and e.get("report")], timeout=30)
    assert event["footprint_bytes"] == 3 * MiB and event["failed_calls"] == 2 and event["seen_by"] == ["cupti"]
    capture = tmp_path / "oom" / event["capture"]
    assert capture.exists() and (tmp_path / "oom" / event["report"]).exists()
    # AND /api/processes and top show it
    doc = _get(port, "/api/processes")
    (row,) = [r for r in doc["processes"] if r["pid"] == pid]
    assert row["oom_events"] == 1
    top = _cli("top", "--once", "--url", f"http://127.0.0.1:{port}")
    assert top.returncode == 0, top.stderr
    lines = top.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    (line,) = [ln for ln in lines if ln.split()[:1] == [str(pid)]]
    assert line.rstrip().endswith(" 1")  # the OOM column
    # AND the daemon logged one line for it
    proc.terminate()
    _, err = proc.communicate(timeout=20)
    oom_lines = [ln for ln in err.splitlines() if f"oom pid={pid} " in ln]
    assert len(oom_lines) == 1 and "footprint_bytes=3145728" in oom_lines[0] and "requested_bytes=unknown" in oom_lines[0]
    # AND the capture replays to its own mark and exports for PyTorch's memory viewer
    replay = _cli("replay", str(capture))
    assert replay.returncode == 0 and "0 differ" in replay.stderr, replay.stderr
    out = tmp_path / "snap.pickle"
    exp = _cli("export", str(capture), "--to", "memory-viz", "-o", str(out))
    assert exp.returncode == 0, exp.stderr
    snap = pickle.loads(out.read_bytes())
    assert sum(s["total_size"] for s in snap["segments"]) == 3 * MiB
    assert [e["action"] for e in snap["device_traces"][0]][-1] == "oom"


def test_a_runtime_oom_is_seen_with_the_defaults_while_buffers_are_forwarded(daemon: Any, tmp_path: Path) -> None:
    """CuPy's way to an OOM: cudaMalloc fails; only the runtime's API record says so (the driver
    call inside writes none). Buffers holding those RUNTIME records go to the daemon unread, and
    the daemon must step over them without losing the memory records beside them."""
    proc, port, sock = daemon
    child = start_probe_child(sock, tmp_path, "sleep:1.0", "alloc:0x1000:2097152", "sleep:0.2",
                              "rtcall:20:0", "alloc:0x400000:1048576", "rtcall:20:2", "sleep:1.5")
    status = finish_probe_child(child)
    pid = child.pid
    assert status["status"]["forwarded_buffers"] > 0 and status["status"]["oom_failed_calls"] == 1
    (event,) = _wait(lambda: [e for e in _get(port, "/api/oom") if e["pid"] == pid and e.get("capture")], timeout=30)
    # the footprint at the failure holds both allocations: the records beside the RUNTIME ones were read
    assert event["footprint_bytes"] == 3 * MiB and event["seen_by"] == ["cupti"] and event["failed_calls"] == 1
    drift = _scrape(port).get("gpufootprint_footprint_drift_mismatches_total", [])
    assert not [v for labels, v in drift if labels.get("pid") == str(pid) and v]


def test_pytorchs_oom_observer_adds_the_requested_size(daemon: Any, tmp_path: Path) -> None:
    proc, port, sock = daemon
    child = start_probe_child(sock, tmp_path, "faketorch", "sleep:0.3", "alloc:0x1000:4194304", "sleep:0.2",
                              "apicall:243:2", "torchoom:1073741824", "sleep:1.5", GPUFOOTPRINT_PROBE_OOM_RECORDS="1")
    finish_probe_child(child)
    (event,) = _wait(lambda: [e for e in _get(port, "/api/oom") if e["pid"] == child.pid and e.get("capture")],
                     timeout=30)
    assert event["requested_bytes"] == 1 << 30 and event["seen_by"] == ["cupti", "torch"]
    assert event["footprint_bytes"] == 4 * MiB and event["notices"] == 2
