"""Under allocation churn a burst opens a launch window only when none opened in the last
``sampler.kernel_window_burst_gap_seconds``, end to end: a default App (fake NVML), a child probe on its
socket that allocates and frees 512 MiB every step (a burst at every watermark) and answers launch windows
with its launch and wait calls, and the daemon's kernel_window CONTROL frames as the child got them and as
/metrics counts them while it runs.

With the gap at 0 only ``kernel_window_min_gap_seconds`` (1 s) separates a window's close from the next
opening, so a process bursting every 60 ms gets a window about every 1.3 s. At the default gap (30 s) the
first burst's window is the only one in the run, however many bursts follow it. The periodic windows
(first 5 s in) are moved past the run in both, so only bursts open windows here.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpufootprint.configload import load_config

sys.path.insert(0, str(Path(__file__).parents[1]))
from nvml_fake import FakeNvml

from tests.daemon_process import scrape

pytestmark = pytest.mark.integration

RUN_S = 6.5  # each child's run: about five windows apart at a burst gap of 0

# Allocation churn around a loop of launches: every ~60 ms step allocates eight 64 MiB buffers and frees
# them (half the 1 GiB the process holds: a burst), runs ten launches and waits 50 ms for the GPU. The
# churn starts 0.3 s in: the burst the first 1 GiB starts ends once that level has held 100 ms
# (``burst_settle_ms``), where churn from the start would hold it open 2 s (``burst_max_ms``). Its
# calls reach the daemon only while a launch window is open, as long as the daemon's last CONTROL asked.
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
    churn = np.zeros(16, MEMORY_DTYPE)
    churn["op"] = [1] * 8 + [2] * 8  # eight allocations, then their releases
    churn["mk"], churn["bytes"], churn["pid"] = 3, 64 << 20, pid
    churn["addr"] = [0x7F0000000000 + (i % 8) * (64 << 20) for i in range(16)]
    got, window_until, calls, steps_sent = [], 0.0, [], 0
    t_start = time.monotonic()
    end = t_start + run_s
    while time.monotonic() < end:
        t0 = time.time_ns()
        if time.monotonic() - t_start >= 0.3:  # past start-up: the burst of the first 1 GiB has settled
            churn["ts"] = t0 + np.arange(16) * 1_000
            s.setblocking(True); s.sendall(encode_batch(RecordKind.MEMORY, churn)); s.setblocking(False)
        t0 += 20_000
        for i in range(10):  # ten launches of 20 us, back to back
            calls.append((ApiRole.LAUNCH, t0 + i * 20_000, t0 + i * 20_000 + 15_000))
        ws = t0 + 200_000
        time.sleep(0.05)  # the GPU runs the step
        calls.append((ApiRole.SYNC, ws, time.time_ns()))
        if time.monotonic() < window_until:
            a = np.zeros(len(calls), API_DTYPE)
            for j, (role, st, en) in enumerate(calls):
                a[j]["start"], a[j]["end"], a[j]["role"], a[j]["tid"], a[j]["pid"], a[j]["domain"] = st, en, role, 7, pid, 5
            s.setblocking(True); s.sendall(encode_batch(RecordKind.API, a)); s.setblocking(False)
            steps_sent += 1
        calls = []
        s.setblocking(True); s.sendall(encode_watermark(time.time_ns())); s.setblocking(False)
        try:
            data = s.recv(65536)
        except BlockingIOError:
            data = b""
        for f in dec.feed(data):
            if f.type == FrameType.CONTROL:
                body = f.json()
                if body.get("op") == "kernel_window":
                    got.append({"t": time.monotonic() - t_start, **body})
                    window_until = time.monotonic() + body["ms"] / 1000
    print(json.dumps({"windows": got, "steps_sent": steps_sent}))
''')

def _counts(port: int) -> tuple[int, int]:
    """/metrics now: kernel_window CONTROLs sent, and anomaly windows closed on a footprint change (bursts)."""
    samples = scrape(port)
    sent = [v for lb, v in samples.get("gpufootprint_sampler_controls_total", [])
            if lb == {"op": "kernel_window", "result": "sent"}]
    bursts = [v for lb, v in samples.get("gpufootprint_anomaly_windows_total", []) if lb == {"reason": "footprint_change"}]
    return int(sum(sent)), int(sum(bursts))


@dataclass
class Run:
    controls: list[dict[str, Any]]  # the kernel_window CONTROL bodies the child got, with "t": seconds into its run
    steps_sent: int  # steps whose calls the child sent inside windows
    # /metrics while the child ran: (seconds since it started, kernel_window CONTROLs sent, bursts closed)
    live: list[tuple[float, int, int]] = field(default_factory=list)

    @property
    def openings(self) -> list[dict[str, Any]]:
        """The first CONTROL of each window (its id): the one that opened it."""
        first: dict[int, dict[str, Any]] = {}
        for c in self.controls:
            first.setdefault(c["id"], c)
        return list(first.values())

    def closed_at(self, wid: int) -> float | None:
        return next((c["t"] for c in self.controls if c["id"] == wid and c["ms"] == 1), None)


def _run(tmp_path: Path, overrides: dict[str, Any]) -> Run:
    from gpufootprint.app import App

    # the defaults (windows every 30 s and at bursts, at least 1 s apart), a /metrics body fresh every 100 ms
    config = load_config(env={}, overrides={"daemon.tick_ms": 20, "exporter.listen": "127.0.0.1:0",
                                            "exporter.render_interval_ms": 100, **overrides})
    sock = str(tmp_path / "probe.sock")
    app = App(config, socket_path=sock, listen="127.0.0.1:0", nvml_client=FakeNvml("healthy", gpus=1))
    app.start()
    live: list[tuple[float, int, int]] = []
    try:
        assert app.http is not None
        child = subprocess.Popen([sys.executable, "-c", CHILD, sock, str(RUN_S)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while child.poll() is None:  # scrape while it runs, as Prometheus would
            sent, bursts = _counts(app.http.port)
            if child.poll() is None:
                live.append((time.monotonic() - t0, sent, bursts))
            time.sleep(0.2)
        out, err = child.communicate(timeout=30)
    finally:
        app.stop()
    assert child.returncode == 0, err
    doc = json.loads(out)
    return Run(doc["windows"], doc["steps_sent"], live)


def test_under_allocation_churn_the_burst_gap_leaves_one_window_where_the_1s_gap_alone_leaves_many(
        tmp_path: Path) -> None:
    # GIVEN a process that bursts at every ~60 ms step and records its steps in every launch window
    # (no periodic window within the run: only bursts open them)
    late_periodic = {"sampler.kernel_window_first_seconds": 600.0}
    # WHEN a burst may open a window whenever the 1 s gap from the last close has passed (burst gap 0)
    free = _run(tmp_path / "free", {**late_periodic, "sampler.kernel_window_burst_gap_seconds": 0.0})
    # AND WHEN the burst gap is the default (30 s)
    bounded = _run(tmp_path / "bounded", late_periodic)
    for run in (free, bounded):
        # (the churn made bursts all along: the daemon closed dozens of anomaly windows while it ran)
        assert run.live and run.live[-1][2] - run.live[0][2] >= 20, run.live
        # (and the first window, opened at the first burst with a 2 s lease, got the child's steps)
        assert run.steps_sent >= 5 and run.openings and run.openings[0]["ms"] == 2000, run
        assert run.openings[0]["records"] == "launches" and run.openings[0]["steps"] == 4, run.openings

    # THEN with a burst gap of 0 a window opens again about every 1 s + its length, at the next burst
    assert len(free.openings) >= 4, free.controls
    for prev, nxt in zip(free.openings, free.openings[1:]):
        closed = free.closed_at(prev["id"])
        assert closed is not None and closed < nxt["t"], free.controls
        # the 1 s gap counts on the daemon's watermarks, a step or two behind the child's clock
        assert 0.8 <= nxt["t"] - closed <= 2.0, free.controls
    # AND /metrics counted them while the child ran: its kernel_window counter (openings and 1 ms closes)
    # climbed past three windows' CONTROLs, and still climbed in the run's second half
    assert max(n for _, n, _ in free.live) >= 2 * 3, free.live
    halfway = [n for t, n, _ in free.live if t <= RUN_S / 2][-1]
    assert free.live[-1][1] > halfway, free.live

    # THEN with the default burst gap the first burst's window is the only one in the whole run, however
    # many bursts came after it
    assert len(bounded.openings) == 1, bounded.controls
    wid = bounded.openings[0]["id"]
    closed = bounded.closed_at(wid)
    assert closed is not None and closed < 2.0, bounded.controls
    assert [c["ms"] for c in bounded.controls] == [2000, 1], bounded.controls  # opened, closed: nothing more
    # AND /metrics, read while the child still ran, stayed at those two CONTROLs from the second second
    # to the end while the anomaly-window counter kept climbing
    late = [(n, b) for t, n, b in bounded.live if t >= 2.0]
    assert late and {n for n, _ in late} == {2}, bounded.live
    assert late[-1][1] - late[0][1] >= 15, bounded.live


def test_each_window_doubles_the_burst_gap_before_the_next_while_the_child_runs(tmp_path: Path) -> None:
    # GIVEN the same churning child, a burst gap of 0.5 s, no minimum gap after a close and no periodic window
    # within the run: only bursts open windows, as often as the back-off lets them
    quick = {"sampler.kernel_window_first_seconds": 600.0, "sampler.kernel_window_burst_gap_seconds": 0.5,
             "sampler.kernel_window_min_gap_seconds": 0.0}
    # WHEN the daemon backs off (the default, up to 600 s) and WHEN it does not (every_max 0)
    backed = _run(tmp_path / "backed", quick)
    flat = _run(tmp_path / "flat", {**quick, "sampler.kernel_window_every_max_seconds": 0.0})
    for run in (backed, flat):
        assert run.steps_sent >= 5 and run.openings, run  # the windows got the child's steps
    # THEN each gap between openings is at least the last one doubled (0.5, 1, 2 s: the gate counts on the
    # daemon's watermarks, a step behind the child's clock), so a 6.5 s run sees three to five windows
    times = [o["t"] for o in backed.openings]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert 3 <= len(times) <= 5, backed.controls
    assert all(g >= 0.5 * 2 ** k - 0.15 for k, g in enumerate(gaps)), gaps
    # AND without the back-off a window reopens every half second or so, past its close, all run long
    assert len(flat.openings) >= 6, flat.controls
    # AND /metrics, read while the child ran, shows it: the backed-off daemon's kernel_window CONTROLs (openings,
    # renewals, closes) stopped climbing in the run's last 1.5 s, the flat one's did not
    for run, climbs in ((backed, False), (flat, True)):
        late = [n for t, n, _ in run.live if t >= RUN_S - 1.5]
        assert late, run.live
        assert (late[-1] > late[0]) is climbs, (climbs, run.live)
