"""Copies and memsets in windows (``probe.copies``) and unified-memory counters at the first managed allocation.

The probe runs for real over the raw fake CUPTI (tests/probe_fakes.py): a kind
that is off at the moment a record is made loses that record, as on the GPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from gpufootprint.probe.core import Probe
from gpufootprint.probe.settings import ProbeSettings
from gpufootprint.records import RecordKind
from gpufootprint.wire.framing import FrameType, iter_frames
from gpufootprint.wire.sources import TraceFile
from tests import probe_fakes as fk


def _run(tmp_path: Path, seconds: float, **settings: Any) -> tuple[dict[str, Any], dict[RecordKind, int], int, float]:
    """A copy every millisecond and an allocation every 10 for ``seconds``; returns status, kinds, copies made."""
    out = tmp_path / "t.gfp"
    fake = fk.FakeRawCupti()
    probe = Probe(ProbeSettings(socket="", tee=str(out), flush_ms=10, **settings), fake, discover_devices=False)
    assert probe.start()
    made = 0
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            fake.emit(fk.memcpy_record(100))
            if made % 10 == 0:
                fake.alloc(0x10_0000 + made * 256, 256)
            made += 1
            time.sleep(0.001)
        elapsed = time.monotonic() - t0
        probe.mark("end")
    finally:
        probe.stop()
    kinds: dict[RecordKind, int] = {}
    for f in iter_frames(TraceFile(out).chunks()):
        if f.type is FrameType.BATCH:
            kinds[RecordKind(f.tag)] = kinds.get(RecordKind(f.tag), 0) + len(f.records())
    return probe.status(), kinds, made, elapsed


def test_copy_windows_record_copies_only_inside_windows_and_report_how_long_they_were_open(tmp_path: Path) -> None:
    # GIVEN copies: windows of 40 ms every 200 ms, and a workload copying every millisecond for 1.2 s
    st, kinds, made, elapsed = _run(tmp_path, 1.2, copies="windows", copy_window_ms=40, copy_period_ms=200)
    got = kinds.get(RecordKind.MEMCPY, 0)
    # THEN some copies were recorded and most were not
    assert 0 < got < made / 2
    # AND the windows opened on their cadence and say how long copies were recorded (6 x 40 ms)
    assert 5 <= st["copy_windows"] <= 8
    assert 0.15 <= st["copy_window_seconds"] <= 0.6
    # AND the share of copies recorded follows the share of time the windows were open
    assert abs(got / made - st["copy_window_seconds"] / elapsed) < 0.15
    # AND every allocation arrived: the footprint's kinds are never windowed
    assert kinds[RecordKind.MEMORY] == (made + 9) // 10


@pytest.mark.parametrize("mode", ["always", "off"])
def test_copies_always_records_every_copy_and_off_none(tmp_path: Path, mode: str) -> None:
    st, kinds, made, elapsed = _run(tmp_path, 0.3, copies=mode)
    if mode == "always":
        assert kinds[RecordKind.MEMCPY] == made
        assert st["copy_window_seconds"] == pytest.approx(elapsed, abs=0.25)
    else:
        assert RecordKind.MEMCPY not in kinds and st["copy_window_seconds"] == 0 and st["copy_windows"] == 0
    assert kinds[RecordKind.MEMORY] == (made + 9) // 10


@pytest.mark.parametrize("raw,expected", [("1", "always"), ("false", "off"), ("windows", "windows"),
                                          ("sometimes", "windows")])
def test_copies_setting_reads_old_booleans_and_falls_back_on_nonsense(raw: str, expected: str) -> None:
    assert ProbeSettings.from_env({"GPUFOOTPRINT_PROBE_COPIES": raw}).copies == expected


def test_unified_memory_counters_are_configured_at_the_first_managed_allocation_only(tmp_path: Path) -> None:
    out = tmp_path / "t.gfp"
    fake = fk.FakeRawCupti()
    probe = Probe(ProbeSettings(socket="", tee=str(out), flush_ms=10), fake, discover_devices=False)
    assert probe.start()
    try:
        # GIVEN device memory only: no unified-memory counters (docs/probe.md: exit abort)
        fake.alloc(0x1000, 4096)
        fake.emit(fk.um_record(1, 4096, 0x7000))  # CUPTI would not make it: the kind is off
        probe.mark("device_only")
        assert fake.um_configurations == 0 and probe.status()["unified_memory_configured"] == 0
        # WHEN the process allocates managed memory
        fake.alloc(0x7000_0000, 64 << 20, mk=5)
        probe.mark("managed")
        # THEN the counters are configured, once, and their records arrive
        fake.emit(fk.um_record(1, 8192, 0x7000_0000))
        fake.alloc(0x8000_0000, 1 << 20, mk=5)
        probe.mark("end")
    finally:
        probe.stop()
    assert fake.um_configurations == 1 and probe.status()["unified_memory_configured"] == 1
    um = [r for f in iter_frames(TraceFile(out).chunks()) if f.type is FrameType.BATCH
          and RecordKind(f.tag) is RecordKind.UNIFIED_MEMORY for r in f.records()]
    assert len(um) == 1 and int(um[0]["value"]) == 8192
