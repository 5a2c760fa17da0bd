"""The probe's link with REAL child processes over a REAL Unix socket and the real IngestServer.

The child (probe_child.py) runs the real probe; only CUPTI is faked, at the
cupti-python boundary. The daemon side is the real IngestServer in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.configload import load_config
from gpufootprint.ingest.server import IngestServer
from gpufootprint.pipeline import Pipeline
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameType

from tests.probe_process import CHILD, finish_probe_child, start_probe_child

ROOT = Path(__file__).resolve().parents[2]


class Daemon:
    def __init__(self, path: str) -> None:
        cfg = load_config(env={})
        self.pipeline = Pipeline(cfg.footprint)
        self.marks: list[dict[str, Any]] = []
        self.server = IngestServer(cfg, self.pipeline, socket_path=path, on_mark=self.marks.append)
        self.pipeline.hub.control = self.server.send_control  # as App wires it
        self.server.open()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(10)

    def wait_mark(self, label: str, timeout: float = 20.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for m in list(self.marks):
                if m["label"] == label:
                    return m
            time.sleep(0.01)
        raise AssertionError(f"mark {label!r} never reached the daemon; got {[m['label'] for m in self.marks]}")

    def counters(self, pid: int) -> dict[str, float]:
        return dict(self.pipeline.processes[pid].probe_counters)


def child(sock: str | Path, sync: Path, *steps: str, **env: str) -> subprocess.Popen[str]:
    return start_probe_child(sock, sync, *steps, **env)


def finish(p: subprocess.Popen[str]) -> dict[str, Any]:
    return finish_probe_child(p, timeout=60)


def test_footprint_at_marks_matches_and_peercred_pins_the_pid(tmp_path: Path) -> None:
    sock = str(tmp_path / "p.sock")
    d = Daemon(sock)
    try:
        p = child(sock, tmp_path, "alloc:0x1000:4096", "alloc:0x200000:1048576", "alloc:0x9000:64:2",
                  "free:0x1000:4096", "copy:512", "mark:one", "burst:300", "alloc:0x5000:10", "mark:two",
                  GPUFOOTPRINT_PROBE_COPIES="always")
        res = finish(p)
        one, two = d.wait_mark("one"), d.wait_mark("two")
    finally:
        d.stop()
    assert one["pid"] == p.pid  # the kernel's SO_PEERCRED pid is the process's own
    assert one["live_bytes"] == {"device": 1048576, "pinned": 64} and one["matches"]
    assert two["live_bytes"] == {"device": 1048586, "pinned": 64} and two["matches"]
    assert res["status"]["records_sent"] == 4 + 1 + 600 + 1  # memory, copy, burst, memory
    assert res["status"]["records_dropped"] == 0
    proc = d.pipeline.processes[p.pid]
    assert proc.info["start_time"] and proc.info["host"]  # the HELLO
    assert proc.exited_at is not None  # the GOODBYE


@pytest.mark.parametrize("native_forward", ["0", "1"], ids=["read_by_the_sender", "by_the_c_forwarder"])
def test_daemon_restart_mid_run_resyncs_the_footprint_and_counts_what_was_lost(tmp_path: Path,
                                                                               native_forward: str) -> None:
    # GIVEN a probe connected to a daemon
    sock = str(tmp_path / "p.sock")
    d1 = Daemon(sock)
    p = child(sock, tmp_path, "alloc:0x1000:1000", "alloc:0x2000:2000", "mark:before", "wait:down",
              "sleep:0.3", "alloc:0x3000:3000", "free:0x1000:1000", "burst:50", "mark:while_down", "touch:did_work",
              "wait:up", "connected", "alloc:0x4000:4000", "mark:after", GPUFOOTPRINT_PROBE_NATIVE_FORWARD=native_forward)
    try:
        assert d1.wait_mark("before")["live_bytes"] == {"device": 3000}
        # WHEN the daemon goes away, the workload allocates and frees, and a new daemon starts
        d1.stop()
        (tmp_path / "down").touch()
        end = time.monotonic() + 20
        while not (tmp_path / "did_work").exists():
            assert time.monotonic() < end
            time.sleep(0.01)
        d2 = Daemon(sock)
        (tmp_path / "up").touch()
        res = finish(p)
        after = d2.wait_mark("after")
    finally:
        d2.stop() if "d2" in locals() else None
    # THEN the new daemon's footprint includes what happened while it was away
    assert after["live_bytes"] == {"device": 2000 + 3000 + 4000} and after["matches"]
    assert [m["label"] for m in d2.marks] == ["after"]
    # AND the probe says what was lost
    st = res["status"]
    assert st["reconnects"] == 1 and st["resyncs"] >= 2
    assert st["records_dropped"] >= 2 + 100  # the alloc/free pair and the burst
    assert st["marks_dropped"] == 1
    assert st["disconnects_peer_closed"] == 1
    counters = d2.counters(p.pid)
    assert counters["records_dropped"] == st["records_dropped"]
    assert (st["native_forwards"] > 0) == (native_forward == "1"), st


def test_without_a_daemon_the_workload_runs_normally_and_drops_are_counted(tmp_path: Path) -> None:
    p = child(str(tmp_path / "nobody.sock"), tmp_path, "burst:2000", "mark:m", "copy:10",
              GPUFOOTPRINT_PROBE_COPIES="always")
    t0 = time.monotonic()
    res = finish(p)
    assert time.monotonic() - t0 < 30
    st = res["status"]
    assert st["started"] and not st["connected"]
    assert st["records_sent"] == 0
    assert st["records_dropped"] == 4001 and st["dropped_daemon_away"] == 4001
    assert st["marks_dropped"] == 1
    assert st["connections_missing"] >= 1
    assert res["workload_s"] < 5.0  # nothing waited on a socket


@pytest.mark.parametrize("kind", ["concurrent", "serial"])
def test_control_messages_open_a_kernel_window_change_the_cadence_and_unknown_ops_are_counted(
        tmp_path: Path, kind: str) -> None:
    sock = str(tmp_path / "p.sock")
    d = Daemon(sock)
    try:
        p = child(sock, tmp_path, "kernel:before_window", "mark:ready", "wait:go", "sleep:0.05",
                  "kernel:gemm", "kernel:gemm", "kernel:softmax", "mark:in_window", "sleep:0.6",
                  "kernel:after_window", "mark:done", GPUFOOTPRINT_PROBE_KERNEL_WINDOW_KIND=kind)
        ready = d.wait_mark("ready")
        pid = ready["pid"]
        for body in ({"op": "flush_interval", "ms": 5}, {"op": "kernel_window", "ms": 300, "id": 7},
                     {"op": "no_such_op"}):
            assert d.server.send(pid, framing.encode_json(FrameType.CONTROL, body))
        assert d.server.send(pid, framing.encode(FrameType.CONTROL, b"not json"))
        time.sleep(0.2)
        (tmp_path / "go").touch()
        res = finish(p)
        d.wait_mark("done")
        fp = d.pipeline.processes[pid].devices[0]
    finally:
        d.stop()
    st = res["status"]
    assert fp.kernel_count == 3  # only the kernels inside the window were recorded
    assert st["kernel_windows"] == 1 and st["control_unknown"] == 2
    assert res["lost_while_disabled"] == 2  # before and after the window CUPTI had the kind off
    # the window switched on the kind asked for, and only that kernel kind
    assert {3, 10} & set(res["enabled_ever"]) == ({3} if kind == "serial" else {10})


def test_record_writes_one_file_for_several_probed_processes(tmp_path: Path) -> None:
    out = tmp_path / "rec.gfp.gz"
    script = ("import subprocess, sys\n"
              f"child, sync = {CHILD!r}, {str(tmp_path)!r}\n"
              "ps = [subprocess.Popen([sys.executable, child, sync, f'alloc:0x1000:{n}', f'kernel:k{n}', f'mark:m{n}'])"
              " for n in (111, 222)]\n"
              "sys.exit(max(p.wait() for p in ps))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "daemon"), GPUFOOTPRINT_PROBE_KERNELS="1")
    r = subprocess.run([sys.executable, "-m", "gpufootprint", "record", "-o", str(out), "--", sys.executable,
                        "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = tmp_path / "rep.json"
    r = subprocess.run([sys.executable, "-m", "gpufootprint", "replay", str(out), "--report-json", str(rep)],
                       env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    report = json.loads(rep.read_text())
    marks = {m["label"]: m for m in report["marks"]}
    assert marks["m111"]["live_bytes"] == {"device": 111} and marks["m222"]["live_bytes"] == {"device": 222}
    assert marks["m111"]["pid"] != marks["m222"]["pid"]
    assert report["ingest_errors"] == {}


def test_gpufootprint_run_returns_the_commands_exit_status_and_probes_its_python_children(tmp_path: Path) -> None:
    sock = str(tmp_path / "p.sock")
    d = Daemon(sock)
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "daemon"))
        code = ("import sys, gpufootprint.probe as p; "
                "sys.exit(41 if 'gpufootprint.probe._autostart' in sys.modules else 3)")
        r = subprocess.run([sys.executable, "-m", "gpufootprint", "run", "--socket", sock, "--", sys.executable,
                            "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False)
    finally:
        d.stop()
    assert r.returncode == 41, r.stderr  # the bootstrap ran the autostart in the child


@pytest.mark.parametrize("value,started", [("", False), ("1", True)])
def test_pth_startup_line_is_inert_unless_enabled(value: str, started: bool) -> None:
    line = (ROOT / "gpufootprint_probe.pth").read_text().strip()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "daemon"), GPUFOOTPRINT_PROBE=value)
    code = f"import sys\n{line}\nprint('gpufootprint.probe._autostart' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(started)


@pytest.mark.parametrize("delivery", ["raw", "objects"])
def test_a_daemon_that_stops_reading_never_blocks_the_workload(tmp_path: Path, delivery: str) -> None:
    # GIVEN a "daemon" that accepts the connection and then never reads from it
    import socket as socketlib

    path = str(tmp_path / "stuck.sock")
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    held: list[socketlib.socket] = []
    threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    try:
        # WHEN the workload produces far more than the kernel's socket buffer and the probe's own
        p = child(path, tmp_path, "sleep:0.2", "burst:20000", "mark:m", GPUFOOTPRINT_PROBE_BUFFER_BYTES="1048576",
                  FAKE_DELIVERY=delivery)
        res = finish(p)
    finally:
        for s in held:
            s.close()
        listener.close()
    # THEN it finished at its own pace, and the probe counted what did not fit
    st = res["status"]
    assert res["workload_s"] < 10
    assert st["dropped_buffer_full"] > 0
    assert st["records_sent"] + st["records_dropped"] == 40000
