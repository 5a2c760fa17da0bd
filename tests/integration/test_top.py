"""``gpufootprint top`` against a running demo (real traces replayed into the daemon, real HTTP),
and /api/processes against /metrics from the same daemon."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pyte
import pytest
from gpufootprint.top import HEADER, WIDTH, gpu_line, render, size

from tests.conftest import cli_env
from tests.daemon_process import free_port, scrape, wait

pytestmark = pytest.mark.integration


@pytest.fixture
def demo():  # type: ignore[no-untyped-def]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpufootprint", "demo", "--listen", f"127.0.0.1:{port}",
                             "--duration", "120"], env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait(lambda: scrape(port).get("gpufootprint_device_bytes"), timeout=30)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufootprint", "top", *args], env=cli_env(), capture_output=True,
                          text=True, timeout=60, check=False)


def test_once_prints_one_frame_of_80_columns_with_every_process(demo: int) -> None:
    doc = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{demo}/api/processes", timeout=10).read())
    pids = {r["pid"] for r in doc["processes"]}
    assert pids
    r = _top("--once", "--url", f"http://127.0.0.1:{demo}", "--sort", "pid")
    assert r.returncode == 0, r.stderr
    # the demo's processes may still be appearing when the first read is made (a loaded machine): top's rows
    # are checked against every process seen before or after it
    doc = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{demo}/api/processes", timeout=10).read())
    pids |= {r["pid"] for r in doc["processes"]}
    lines = r.stdout.splitlines()
    assert all(len(line) <= WIDTH for line in lines)
    assert HEADER in lines
    rows = lines[lines.index(HEADER) + 1:]
    assert [int(line.split()[0]) for line in rows] == sorted(int(line.split()[0]) for line in rows)
    assert {int(line.split()[0]) for line in rows} <= pids and len(rows) >= 1


def test_api_processes_agrees_with_metrics(demo: int) -> None:
    # the demo replays in a loop: compare one process's device bytes from two reads that agree in time
    def same() -> Any:
        a = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{demo}/api/processes", timeout=10).read())
        m = {(lb["pid"], lb["gpu"]): v for lb, v in scrape(demo)["gpufootprint_device_bytes"]}
        b = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{demo}/api/processes", timeout=10).read())
        rows = {(str(r["pid"]), str(r["gpu"])): r["device_bytes"] for r in a["processes"] if not r["exited"]}
        rows_b = {(str(r["pid"]), str(r["gpu"])): r["device_bytes"] for r in b["processes"] if not r["exited"]}
        return rows if rows == rows_b and rows and all(m.get(k) == v for k, v in rows.items()) else None

    assert wait(same, timeout=30)


def test_an_unreachable_daemon_is_a_one_line_error(tmp_path: Path) -> None:
    port = free_port()
    r = _top("--once", "--url", f"http://127.0.0.1:{port}")
    assert r.returncode == 1
    assert r.stderr.strip().startswith(f"gpufootprint top: error: http://127.0.0.1:{port}/api/processes: cannot connect")
    assert len(r.stderr.strip().splitlines()) == 1


def _doc() -> dict[str, Any]:
    row = {"pid": 123456, "gpu": 0, "source": "probe", "exited": False, "command": "python /very/long/path/train.py",
           "pod": None, "device_bytes": 131_074 << 20, "window_peak_bytes": 140 << 30,
           "live_bytes": {"device": 130 << 30, "pinned": 2 << 30, "untracked": 1 << 30},
           "allocator_slack_bytes": 3 << 30, "sampler_mode": "burst", "graph_verdict": "capture",
           "leak_suspect": True, "oom_events": 123}
    small = dict(row, pid=7, pod="trainer-0-with-a-very-long-name", device_bytes=512, window_peak_bytes=1024,
                 live_bytes={}, allocator_slack_bytes=None, sampler_mode=None, graph_verdict=None,
                 leak_suspect=None, oom_events=0)
    return {"taken_at": 0, "window_peak_seconds": 60.0, "processes": [small, row],
            "gpus": [{"gpu": 0, "model": "NVIDIA H200 with a long model name", "used_bytes": 139 << 30,
                      "total_bytes": 140 << 30, "probed_bytes": 131 << 30}]}


def test_render_fits_80_columns_even_with_extreme_values() -> None:
    lines = render(_doc(), "device", source="http://a-very-long-host-name.example:9878")
    assert all(len(line) <= 80 for line in lines)
    big, small = lines[3], lines[4]
    assert big.split()[0] == "123456" and "128.0GiB" in big and "dev98 pin2" in big and "BURST" in big
    assert "CAPT" in big and big.rstrip().endswith("L 99")
    assert small.split()[1] == "trainer-0-wit" and small.split()[3] == "512B"
    assert render(_doc(), "pid")[3].split()[0] == "7"
    assert render(_doc(), "oom")[3].split()[0] == "123456"


def test_sizes_are_binary_units_as_the_demo_and_the_report_print_them() -> None:
    # MiB and GiB, as the demo's table, the report, nvidia-smi and nvitop say; at most 8 characters
    cases = {None: "-", 0: "0B", 999: "999B", 1024: "1.00KiB", 70 << 20: "70.0MiB", 999 << 20: "999.0MiB",
             1000 << 20: "0.98GiB", 1536 << 20: "1.50GiB", 131_074 << 20: "128.0GiB"}
    assert {n: size(n) for n in cases} == cases
    assert all(len(size(n)) <= 8 for n in range(0, 1 << 44, 1 << 33))


@pytest.mark.parametrize("model", ["NVIDIA H200 (simulated)", "NVIDIA H200 NVL with a long model name (simulated)",
                                   "A" * 90 + " (x)", None])
def test_the_gpu_line_fits_and_never_cuts_inside_parentheses(model: str | None) -> None:
    g = {"gpu": 7, "model": model, "used_bytes": 139 << 30, "total_bytes": 140 << 30, "probed_bytes": 131 << 30}
    line = gpu_line(g)
    assert len(line) <= WIDTH, line
    assert line.count("(") == line.count(")"), line
    assert line.endswith("used 139.0GiB / 140.0GiB  probed 131.0GiB"), line  # the figures are never cut
    if model and len(model) < 40:
        assert model in line


def test_the_demo_table_lists_the_processes_top_lists(tmp_path: Path) -> None:
    """The demo's own screen and `top --once` against it show the same (process, GPU) rows.

    Demo processes restart when their trace loops, so the two are compared at the same moment:
    top's rows must hold every row of the demo's screens just before and just after it ran, and
    nothing that neither screen shows."""
    port = free_port()
    out = tmp_path / "demo.out"
    with open(out, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "gpufootprint", "demo", "--listen", f"127.0.0.1:{port}",
                                 "--duration", "16"], env=cli_env(), stdout=fh, stderr=subprocess.DEVNULL, text=True)
        try:
            wait(lambda: len(scrape(port).get("gpufootprint_device_bytes", [])) >= 3, timeout=30)
            time.sleep(3)
            screens_before = out.read_text().count("gpufootprint demo: real H200 traces")
            r = _top("--once", "--url", f"http://127.0.0.1:{port}", "--sort", "pid")
            screens_after = out.read_text().count("gpufootprint demo: real H200 traces")
        finally:
            proc.wait(60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    gp = HEADER.index(" GP") + 1  # the GPU column (a command name may hold spaces: split() would not do)
    top_rows = {(int(ln[:7]), int(ln[gp:gp + 2])) for ln in lines[lines.index(HEADER) + 1:]}
    assert len(top_rows) >= 3

    def rows(screen: str) -> set[tuple[int, int]]:
        text = screen.splitlines()
        head = next(i for i, ln in enumerate(text) if ln.split()[:2] == ["pid", "gpu"])
        return {(int(ln.split()[0]), int(ln.split()[1])) for ln in text[head + 1:] if ln.strip()[:1].isdigit()}

    screens = [rows(sc) for sc in out.read_text().split("gpufootprint demo: real H200 traces")[1:]]
    # the screens printed last before top ran and first after it (the same one when none came between)
    before, after = screens[max(screens_before - 1, 0)], screens[min(screens_after, len(screens) - 1)]
    assert before & after <= top_rows <= before | after, (before, top_rows, after)


def test_live_view_draws_in_a_terminal_and_takes_its_keys(demo: int) -> None:
    """The curses view in a real pseudo-terminal of 80x24: it draws the table, re-sorts on a key, quits on q."""
    import fcntl
    import os
    import select
    import struct
    import termios
    import time

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {**cli_env(), "TERM": "xterm", "LINES": "24", "COLUMNS": "80"}
    proc = subprocess.Popen([sys.executable, "-m", "gpufootprint", "top", "--url", f"http://127.0.0.1:{demo}",
                             "--interval", "0.2"], stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    seen = b""

    def read_until(needle: bytes, timeout: float = 30) -> bool:
        nonlocal seen
        start = len(seen)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    return needle in seen[start:]
            if needle in seen[start:]:
                return True
        return False

    try:
        assert read_until(b"POD/COMMAND"), seen[-2000:]
        time.sleep(0.5)
        read_until(b"\x1b", timeout=0.5)
        # the screen as a terminal shows it (curses redraws only what changed)
        screen = pyte.Screen(80, 24)
        stream = pyte.ByteStream(screen)
        stream.feed(seen)
        assert "sort device" in screen.display[0] and screen.display[2].startswith("    PID POD/COMMAND")
        os.write(master, b"p")
        deadline = time.monotonic() + 30
        while "sort peak" not in screen.display[0] and time.monotonic() < deadline:
            mark = len(seen)
            read_until(b"\x1b", timeout=0.5)
            stream.feed(seen[mark:])
        assert "sort peak" in screen.display[0], screen.display
        os.write(master, b"q")
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
