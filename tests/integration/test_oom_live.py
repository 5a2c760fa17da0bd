"""An OOM as a user meets it: a probed process (fake CUPTI at the edge) fails its allocations under
a real daemon; the event is in /metrics, /api/oom, /api/processes and ``top``, and the capture
opens in ``report`` and ``export``. Real processes, a real Unix socket, real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cli_env
from tests.daemon_process import scrape, wait
from tests.probe_process import finish_probe_child, start_probe_child

pytestmark = pytest.mark.integration

MiB = 1 << 20


@pytest.fixture
def daemon(daemons, tmp_path: Path):  # type: ignore[no-untyped-def]
    return daemons("--set", f"oom.directory={tmp_path / 'oom'}", "--set", "footprint.reorder_window_ms=0",
                   "--set", "oom.coalesce_seconds=0.5").ready()


@pytest.fixture
def default_daemon(daemons, tmp_path: Path):  # type: ignore[no-untyped-def]
    """The daemon as deployed: every timing at its default."""
    return daemons("--set", f"oom.directory={tmp_path / 'oom'}").ready()


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufootprint", *args], env=cli_env(), capture_output=True,
                          text=True, timeout=120, check=False)


def test_a_driver_level_oom_is_counted_logged_captured_and_shown(daemon: Any, tmp_path: Path) -> None:
    port, sock = daemon.port, daemon.sock
    # GIVEN a process holding 3 MiB that then fails cuMemAlloc_v2 twice (a framework's retry)
    child = start_probe_child(sock, tmp_path, "sleep:1.0", "alloc:0x1000:2097152", "alloc:0x400000:1048576",
                              "sleep:0.2", "apicall:243:2", "apicall:243:2", "sleep:1.5")
    status = finish_probe_child(child)
    pid = child.pid
    assert status["status"]["started"]
    # the daemon reads CUPTI's buffers itself (they are forwarded unread): the probe still saw the failures,
    # in its one C read of each buffer (its return values looked at there)
    assert status["status"]["forwarded_buffers"] > 0 and status["status"]["oom_failed_calls"] == 2
    assert status["status"]["native_reads"] == status["status"]["forwarded_buffers"]
    # THEN one event in /metrics, for that pid
    events = wait(lambda: [v for labels, v in scrape(port).get("gpufootprint_oom_events_total", [])
                            if labels["pid"] == str(pid)], timeout=20)
    assert events == [1.0]
    # AND /api/oom lists its capture, with the footprint at the failure
    (event,) = wait(lambda: [e for e in _get(port, "/api/oom") if e["pid"] == pid and e.get("report")], timeout=30)
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
    daemon.stop()
    err = daemon.log()
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


@pytest.mark.parametrize("native_forward", ["0", "1"], ids=["read_by_the_sender", "by_the_c_forwarder"])
def test_a_runtime_oom_is_seen_with_the_defaults_while_buffers_are_forwarded(daemon: Any, tmp_path: Path,
                                                                             native_forward: str) -> None:
    """CuPy's way to an OOM: cudaMalloc fails; only the runtime's API record says so (the driver
    call inside writes none). Buffers holding those RUNTIME records go to the daemon unread, and
    the daemon must step over them without losing the memory records beside them."""
    port, sock = daemon.port, daemon.sock
    child = start_probe_child(sock, tmp_path, "sleep:1.0", "alloc:0x1000:2097152", "sleep:0.2",
                              "rtcall:20:0", "alloc:0x400000:1048576", "rtcall:20:2", "sleep:1.5",
                              GPUFOOTPRINT_PROBE_NATIVE_FORWARD=native_forward)
    status = finish_probe_child(child)
    pid = child.pid
    assert status["status"]["forwarded_buffers"] > 0 and status["status"]["oom_failed_calls"] == 1
    # the forwarder hands a buffer with a failed call to the sender, which reads it and forwards it itself
    assert (status["status"]["native_forward_handed"] > 0) == (native_forward == "1"), status["status"]
    (event,) = wait(lambda: [e for e in _get(port, "/api/oom") if e["pid"] == pid and e.get("capture")], timeout=30)
    # the footprint at the failure holds both allocations: the records beside the RUNTIME ones were read
    assert event["footprint_bytes"] == 3 * MiB and event["seen_by"] == ["cupti"] and event["failed_calls"] == 1
    drift = scrape(port).get("gpufootprint_footprint_drift_mismatches_total", [])
    assert not [v for labels, v in drift if labels.get("pid") == str(pid) and v]


def test_pytorchs_oom_observer_adds_the_requested_size(daemon: Any, tmp_path: Path) -> None:
    port, sock = daemon.port, daemon.sock
    child = start_probe_child(sock, tmp_path, "faketorch", "sleep:0.3", "alloc:0x1000:4194304", "sleep:0.2",
                              "apicall:243:2", "torchoom:1073741824", "sleep:1.5", GPUFOOTPRINT_PROBE_OOM_RECORDS="1")
    finish_probe_child(child)
    (event,) = wait(lambda: [e for e in _get(port, "/api/oom") if e["pid"] == child.pid and e.get("capture")],
                     timeout=30)
    assert event["requested_bytes"] == 1 << 30 and event["seen_by"] == ["cupti", "torch"]
    assert event["footprint_bytes"] == 4 * MiB and event["notices"] == 2


def _live_device(port: int, pid: int) -> float | None:
    for labels, v in scrape(port).get("gpufootprint_live_bytes", []):
        if labels["pid"] == str(pid) and labels["kind"] == "device":
            return v
    return None


def _oom_events(port: int, pid: int) -> list[dict[str, Any]]:
    return [e for e in _get(port, "/api/oom") if e["pid"] == pid]


def _metric(port: int, name: str, pid: int) -> list[float]:
    return [v for labels, v in scrape(port).get(name, []) if labels.get("pid") == str(pid)]


@pytest.mark.parametrize("native_forward", ["0", "1"], ids=["read_by_the_sender", "by_the_c_forwarder"])
@pytest.mark.parametrize("failure", ["rtcall:20:2", "apicall:243:2"])
def test_a_process_that_survives_its_oom_keeps_streaming_and_gets_its_event_while_it_lives(
        default_daemon: Any, tmp_path: Path, failure: str, native_forward: str) -> None:
    """CuPy, Numba, JAX and PyTorch each catch an out-of-memory error and go on. The daemon's live view
    must follow the survivor after the failure, and the OOM event must come while it lives, within
    2 s after the failure's 1 s recovery window closes, not at exit."""
    port, sock = default_daemon.port, default_daemon.sock
    child = start_probe_child(sock, tmp_path, "sleep:0.5", "alloc:0x1000:2097152", "touch:first", "wait:checked_first",
                              "sleep:0.2", "touch:failing", failure, "sleep:0.3", "alloc:0x400000:1048576", "touch:second",
                              "wait:checked_second", "free:0x1000:2097152", "touch:third", "wait:checked_third",
                              GPUFOOTPRINT_PROBE_NATIVE_FORWARD=native_forward)
    try:
        pid = child.pid
        wait(lambda: (tmp_path / "first").exists(), timeout=20)
        assert wait(lambda: _live_device(port, pid) == 2 * MiB, timeout=5)
        (tmp_path / "checked_first").touch()
        wait(lambda: (tmp_path / "failing").exists(), timeout=20)
        failed_at = time.monotonic()
        wait(lambda: (tmp_path / "second").exists(), timeout=20)
        # WHEN the process allocates after its failure, THEN the daemon shows it within the usual delay
        assert wait(lambda: _live_device(port, pid) == 3 * MiB, timeout=3)
        # AND the OOM event, its metric and its capture come while it still runs, on time
        (event,) = wait(lambda: _oom_events(port, pid), timeout=6)
        assert wait(lambda: _metric(port, "gpufootprint_oom_events_total", pid), timeout=3) == [1.0]
        assert time.monotonic() - failed_at < 1.0 + 2.0 + 0.5  # the window, the bound, the scrape's own step
        assert child.poll() is None
        assert event["footprint_bytes"] == 2 * MiB and event["failed_calls"] == 1 and event["gpu"] == 0
        assert wait(lambda: [e for e in _oom_events(port, pid) if e.get("capture")], timeout=5)
        assert (tmp_path / "oom" / event["capture"]).exists()
        assert child.poll() is None
        (tmp_path / "checked_second").touch()
        wait(lambda: (tmp_path / "third").exists(), timeout=20)
        # AND the stream goes on after the event
        assert wait(lambda: _live_device(port, pid) == 1 * MiB, timeout=3)
        assert child.poll() is None
        (tmp_path / "checked_third").touch()
        status = finish_probe_child(child)
        assert status["status"].get("sender_errors", 0) == 0 and status["status"]["oom_failed_calls"] == 1
        assert (status["status"]["native_forwards"] > 0) == (native_forward == "1"), status["status"]
    finally:
        for name in ("checked_first", "checked_second", "checked_third"):
            (tmp_path / name).touch()
        if child.poll() is None:
            child.kill()


def test_a_program_that_fails_frees_and_fails_again_in_a_loop_gets_one_capture_and_a_count(
        default_daemon: Any, tmp_path: Path) -> None:
    """A loop that catches its OOM, frees something and tries again, every 1.2 s (a training step that
    retries with a smaller batch; longer than ``oom.coalesce_seconds``) for 7 s: one event and one
    capture, made on time while the loop still runs, and every failed call counted."""
    port, sock = default_daemon.port, default_daemon.sock
    loop = []
    for i in range(6):
        loop += ["rtcall:20:2", f"alloc:{0x100000 * (i + 1):#x}:4096", f"free:{0x100000 * (i + 1):#x}:4096",
                 "sleep:1.2"]
    child = start_probe_child(sock, tmp_path, "sleep:0.5", "alloc:0x1000:2097152", "sleep:0.2", "touch:failing",
                              *loop, "touch:done", "wait:checked")
    try:
        pid = child.pid
        wait(lambda: (tmp_path / "failing").exists(), timeout=20)
        # THEN the event comes while the loop still fails
        (event,) = wait(lambda: _oom_events(port, pid), timeout=4)
        assert not (tmp_path / "done").exists()
        wait(lambda: (tmp_path / "done").exists(), timeout=20)
        # AND once the episode is over every failure is counted, in one event with one capture
        assert wait(lambda: _metric(port, "gpufootprint_oom_failed_calls_total", pid) == [6.0], timeout=6)
        assert _metric(port, "gpufootprint_oom_events_total", pid) == [1.0]
        (event,) = _oom_events(port, pid)
        assert event["failed_calls"] == 6
        assert wait(lambda: _oom_events(port, pid)[0].get("capture"), timeout=5)
        assert len(list((tmp_path / "oom").glob("oom-*"))) == 1
        assert [v for _, v in scrape(port)["gpufootprint_oom_captures_total"]] == [1.0]
        assert child.poll() is None
    finally:
        (tmp_path / "checked").touch()
        if child.poll() is None:
            finish_probe_child(child)
