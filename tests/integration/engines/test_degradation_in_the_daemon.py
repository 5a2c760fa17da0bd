"""Degradation advice end to end: the stateful NVML fake feeds the daemon's NVML poller, the
daemon's tick builds snapshots on a fake clock, the engines advise, and /api/engines and
/metrics (real HTTP) show the advice appear and clear.

The ingest thread is not started: each step moves the fake clock and runs the daemon's own
tick (what the thread runs every ``daemon.tick_ms``), so five minutes pass in a moment and
the test never waits on the machine's clock.
The processes holding memory are put in the pipeline as a probe's records would be (the
probe itself is tested over the real socket elsewhere); their pids are this test's and its
parent's, live, as the daemon's liveness check wants.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from typing import Any

import numpy as np
import pytest
from gpufootprint.app import App
from gpufootprint.configload import load_config
from gpufootprint.records import MEMORY_DTYPE, RecordKind
from nvml_fake import GIB, FakeNvml

pytestmark = pytest.mark.integration
S = 1_000_000_000
# Live pids: the daemon marks a probe process whose pid is gone as exited (its liveness check).
A, B = os.getpid(), os.getppid()


class Daemon:
    def __init__(self, nvml: FakeNvml) -> None:
        self.now = 1_800_000_000 * S
        self.app = App(load_config(None, env={}), socket_path=None, listen="127.0.0.1:0", nvml_client=nvml,
                       clock_ns=lambda: self.now)
        assert self.app.nvml is not None and self.app.http is not None
        self.app.nvml.start()  # not its thread: the tick polls it, on the fake clock
        self.app.http.start()

    def allocate(self, pid: int, gpu: int, nbytes: int, addr: int, op: int = 1) -> None:
        recs = np.zeros(1, MEMORY_DTYPE)
        recs["ts"], recs["op"], recs["mk"], recs["addr"], recs["bytes"] = self.now, op, 3, addr, nbytes
        recs["pid"], recs["dev"] = pid, gpu
        with self.app.ingest.lock:
            self.app.pipeline.process(pid, "probe")
            self.app.pipeline.submit(RecordKind.MEMORY, recs)

    def step(self, seconds: float) -> None:
        self.now += int(seconds * S)
        self.app.ingest.tick()

    def advice(self) -> set[tuple[int, int, str]]:
        assert self.app.http is not None
        api: dict[str, Any] = json.loads(urllib.request.urlopen(
            self.app.http.url.replace("/metrics", "/api/engines"), timeout=10).read())
        got = {(a["gpu"], a["pid"], a["advice"]) for a in api["degradation"]}
        want = {f'gpufootprint_degradation_advice{{advice="{adv}",gpu="{gpu}",pid="{pid}"}} 1.0'
                for gpu, pid, adv in got}
        # /metrics serves a body rendered every exporter.render_interval_ms (real time): wait for it
        deadline = time.monotonic() + 15
        while True:
            text = urllib.request.urlopen(self.app.http.url, timeout=10).read().decode()
            exported = {line for line in text.splitlines() if line.startswith("gpufootprint_degradation_advice{")}
            if exported == want or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert exported == want
        return got

    def close(self) -> None:
        self.app.stop()


def test_smaller_gpu_after_five_minutes_under_30_percent_and_cleared_when_busy_again() -> None:
    nvml = FakeNvml("healthy")
    nvml.set_utilization(0, 0.10)
    nvml.set_utilization(1, 0.90)
    d = Daemon(nvml)
    try:
        d.allocate(A, 0, 10 * GIB, 0x1000)
        d.allocate(B, 1, 10 * GIB, 0x2000)
        d.step(1)
        seen: list[tuple[float, set[tuple[int, int, str]]]] = []
        for i in range(35):  # 350 s of 10 s ticks
            d.step(10)
            seen.append((10.0 * (i + 1), d.advice()))
        # not before 5 minutes of low utilisation, then for the process on the idle GPU only
        assert all(not adv for t, adv in seen if t < 300)
        assert seen[-1][1] == {(0, A, "smaller_gpu")}
        assert next(t for t, adv in seen if adv) in (300.0, 310.0)
        # GIVEN the GPU gets busy: the advice clears at the next poll
        nvml.set_utilization(0, 0.55)
        d.step(10)
        assert d.advice() == set()
        # and a single low sample later does not bring it back
        nvml.set_utilization(0, 0.05)
        d.step(10)
        assert d.advice() == set()
    finally:
        d.close()


def test_fp16_advice_above_80_percent_of_the_gpu_and_cleared_when_the_peak_leaves_the_window() -> None:
    nvml = FakeNvml("healthy")
    d = Daemon(nvml)  # utilisation 0.42 on both: no smaller_gpu advice
    try:
        d.allocate(A, 1, 100 * GIB, 0x3000)  # 100 of 141 GiB: 71%
        d.step(1)
        d.step(10)
        assert d.advice() == set()
        d.allocate(A, 1, 20 * GIB, 0x4000)  # 120 of 141 GiB: 85%
        d.step(10)
        assert d.advice() == {(1, A, "fp16_gradient_checkpointing")}
        d.allocate(A, 1, 20 * GIB, 0x4000, op=2)  # back to 100 GiB
        d.step(10)
        # still in the 60 s window of the peak
        assert d.advice() == {(1, A, "fp16_gradient_checkpointing")}
        for _ in range(7):
            d.step(10)
        assert d.advice() == set()
    finally:
        d.close()
