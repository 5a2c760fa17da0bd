"""The daemon and the demo as a user runs them: real processes, real sockets, real HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import cli_env
from tests.daemon_process import free_port, scrape, wait


@pytest.fixture
def daemon(daemons):  # type: ignore[no-untyped-def]
    return daemons("--set", "footprint.reorder_window_ms=0", "--set", "footprint.process_grace_seconds=1").ready()


# A real child process speaking the wire protocol, as a probe would.
_CHILD = r"""
import os, socket, sys, time
sys.path.insert(0, {daemon_dir!r})
from tests.conftest import mem, mem_batch, ALLOC, FREE
from gpufootprint.records import RecordKind
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json, encode_watermark
pid = {claimed_pid} or os.getpid()
s = socket.socket(socket.AF_UNIX); s.connect({sock!r})
s.sendall(PREAMBLE + encode_json(FrameType.HELLO, {{"pid": pid, "start_time": 1}}))
now = time.time_ns()
rows = [mem(now - 3_000_000, ALLOC, 0x1000, 64 << 20, pid=pid), mem(now - 2_000_000, ALLOC, 0x2000, 900 << 20, pid=pid),
        mem(now - 1_000_000, FREE, 0x2000, 900 << 20, pid=pid)]
s.sendall(encode_batch(RecordKind.MEMORY, mem_batch(rows)) + encode_watermark(now))
if {claimed_pid}:  # and records for a third pid, neither its own nor the one it claimed
    s.sendall(encode_batch(RecordKind.MEMORY, mem_batch([mem(now, ALLOC, 0x9000, 1 << 30, pid={claimed_pid} + 1)])))
print("sent", flush=True)
sys.stdin.readline()
if {goodbye}:
    s.sendall(encode_json(FrameType.GOODBYE, {{"counters": {{"records_sent": 3}}}}))
s.close()
"""


def _child(sock: Path, *, claimed_pid: int = 0, goodbye: bool = True) -> subprocess.Popen[str]:
    code = _CHILD.format(daemon_dir=str(Path(__file__).resolve().parents[2] / "daemon"), sock=str(sock),
                         claimed_pid=claimed_pid, goodbye=goodbye)
    env = cli_env()
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env["PYTHONPATH"]
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    assert child.stdout is not None and child.stdout.readline().strip() == "sent"
    return child


def _live(port: int, pid: int) -> dict[str, float]:
    return {lab["kind"]: v for lab, v in scrape(port).get("gpufootprint_live_bytes", []) if lab["pid"] == str(pid)}


def test_probe_process_footprint_and_spike_reach_metrics_and_vanish_after_exit(daemon) -> None:  # type: ignore[no-untyped-def]
    port, sock = daemon.port, daemon.sock
    assert oct(sock.stat().st_mode & 0o777) == "0o600"
    child = _child(sock)
    pid = child.pid
    assert wait(lambda: _live(port, pid) == {"device": 64 << 20})
    peaks = {lab["pid"]: v for lab, v in scrape(port)["gpufootprint_window_peak_bytes"]}
    assert peaks[str(pid)] == (64 + 900) << 20, "the 1 ms spike is in the window peak"
    child.communicate("\n", timeout=10)
    # After the goodbye, the process holds nothing, then its series go (grace 1 s).
    wait(lambda: _live(port, pid) == {})
    wait(lambda: all(lab["pid"] != str(pid) for lab, _ in scrape(port).get("gpufootprint_device_bytes", [])))


def test_a_probe_cannot_report_for_another_pid(daemon) -> None:  # type: ignore[no-untyped-def]
    port, sock = daemon.port, daemon.sock
    # The child says it is pid 1 (as a probe in a container's pid namespace could) and also
    # sends records for pid 2. What it says of "itself" lands on its kernel pid (SO_PEERCRED);
    # records for any other pid are dropped and counted.
    child = _child(sock, claimed_pid=1)
    errors = wait(lambda: {lab["reason"]: v for lab, v in scrape(port).get("gpufootprint_ingest_errors_total", [])
                            if lab["reason"] == "pid_mismatch"})
    assert errors["pid_mismatch"] >= 1
    assert wait(lambda: _live(port, child.pid) == {"device": 64 << 20})
    assert _live(port, 1) == {} and _live(port, 2) == {}
    child.communicate("\n", timeout=10)


def test_garbage_peer_is_cut_off_alone_and_a_good_peer_is_untouched(daemon) -> None:  # type: ignore[no-untyped-def]
    port, sock = daemon.port, daemon.sock
    good = _child(sock, goodbye=False)
    bad = socket.socket(socket.AF_UNIX)
    bad.connect(str(sock))
    bad.sendall(os.urandom(4096))
    bad.settimeout(5)
    assert bad.recv(1) == b"", "the daemon closes the bad peer"
    bad.close()
    assert wait(lambda: _live(port, good.pid) == {"device": 64 << 20})
    assert daemon.proc.poll() is None
    # The count reaches /metrics with the next snapshot (every daemon.tick_ms).
    bad_frames = wait(lambda: {lab["reason"]: v for lab, v in
                                scrape(port).get("gpufootprint_ingest_errors_total", [])}.get("bad_frame"))
    assert bad_frames >= 1
    good.communicate("\n", timeout=10)


def test_demo_serves_non_zero_live_bytes_within_10_seconds() -> None:
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "gpufootprint", "demo", "--listen", f"127.0.0.1:{port}",
                             "--duration", "30"], env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        live = wait(lambda: [v for lab, v in scrape(port).get("gpufootprint_live_bytes", [])
                              if lab["kind"] == "device" and v > 0], timeout=10)
        assert live and time.monotonic() - started < 10
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            assert resp.status == 200
    finally:
        proc.terminate()
        out, _err = proc.communicate(timeout=10)
    assert "gpufootprint demo" in out and "/metrics" in out


def test_daemon_without_gpu_says_so_once_and_keeps_serving(daemon) -> None:  # type: ignore[no-untyped-def]
    port = daemon.port
    metrics = scrape(port)
    present = metrics["gpufootprint_daemon_gpu_present"][0][1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
        assert resp.status == 200
    returncode = daemon.stop()
    err = daemon.log()
    if present == 0:
        assert err.count("no GPU") == 1, err
    assert returncode == 0
