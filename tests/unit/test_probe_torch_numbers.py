"""PyTorch's allocator figures reach the heartbeat without the probe's thread ever asking torch.

``torch.cuda.memory_allocated`` takes the allocator's mutex holding the GIL; asked from the
probe's thread while the workload's thread holds that mutex inside cudaMalloc and waits in
CUPTI's (Python) buffer callback for the GIL, neither thread moves again (two of three
16-worker starts of bench/overhead.py on the H200 hung in a probed worker, 2026-12-04). The
figures are read after an optimizer step, on the workload's thread.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from gpufootprint.probe.core import Probe
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.probe.torchnumbers import TorchNumbers
from gpufootprint.wire.framing import FrameType, iter_frames
from gpufootprint.wire.sources import TraceFile

from tests import probe_fakes as fk


def _torch_that_records_its_callers(allocated: int, reserved: int) -> tuple[Any, list[str], list[Any]]:
    callers: list[str] = []
    hooks: list[Any] = []
    torch = fk.fake_torch(reserved=reserved, allocated=allocated)

    def stat(value: int) -> Any:
        def read(_d: int = 0) -> int:
            callers.append(threading.current_thread().name)
            return value
        return read

    torch.cuda.memory_allocated, torch.cuda.memory_reserved = stat(allocated), stat(reserved)
    torch.optim = SimpleNamespace(optimizer=SimpleNamespace(register_optimizer_step_post_hook=hooks.append))
    return torch, callers, hooks


def test_heartbeats_carry_figures_read_on_the_workloads_thread_only(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    torch, callers, hooks = _torch_that_records_its_callers(allocated=2 << 30, reserved=3 << 30)
    monkeypatch.setitem(sys.modules, "torch", torch)
    path = tmp_path / "t.gfp"
    probe = Probe(ProbeSettings(socket="", tee=str(path), flush_ms=10, heartbeat_ms=50), fk.FakeRawCupti(),
                  discover_devices=False)
    assert probe.start()
    try:
        deadline = time.monotonic() + 5
        while not hooks and time.monotonic() < deadline:  # the probe registers its hook from a heartbeat
            time.sleep(0.01)
        assert len(hooks) == 1
        time.sleep(0.2)  # heartbeats before any optimizer step: no figures, and torch never asked
        assert callers == []
        hooks[0](object(), (), {})  # optimizer.step() returned, on this (the workload's) thread
        time.sleep(0.3)
    finally:
        probe.stop()
    assert callers and set(callers) == {threading.main_thread().name}, callers
    beats = [f.json() for f in iter_frames(TraceFile(path).chunks()) if f.type is FrameType.HEARTBEAT]
    with_torch = [b["torch"] for b in beats if "torch" in b]
    assert with_torch and with_torch[-1] == {"allocated": {"0": 2 << 30}, "reserved": {"0": 3 << 30}}
    assert "torch" not in beats[0]


def test_a_step_hook_reads_at_most_once_per_interval_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    torch, callers, hooks = _torch_that_records_its_callers(allocated=1, reserved=2)
    monkeypatch.setitem(sys.modules, "torch", torch)
    numbers = TorchNumbers(min_interval_s=60)
    assert numbers.hook() and numbers.hook() and len(hooks) == 1  # registered once
    for _ in range(1000):  # a thousand steps in a minute: one reading
        hooks[0](None, (), {})
    assert numbers.readings == 1 and len(callers) == 2
    numbers._read_at = -float("inf")
    torch.cuda.memory_allocated = lambda _d=0: 1 / 0  # a broken torch: the step still returns
    hooks[0](None, (), {})
    assert numbers.latest == {"allocated": {"0": 1}, "reserved": {"0": 2}}


def test_without_an_optimizer_hook_there_are_no_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", fk.fake_torch(reserved=3, allocated=2))  # no torch.optim
    numbers = TorchNumbers()
    assert numbers.hook() is False and numbers.latest == {}
