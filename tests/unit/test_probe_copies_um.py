"""Copies and memsets (``probe.copies``: off by default) and unified-memory counters at the first managed allocation.

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


@pytest.mark.parametrize("mode", ["always", "off"])
def test_copies_always_records_every_copy_and_off_none(tmp_path: Path, mode: str) -> None:
    _, kinds, made, _ = _run(tmp_path, 0.3, copies=mode)
    if mode == "always":
        assert kinds[RecordKind.MEMCPY] == made
    else:
        assert RecordKind.MEMCPY not in kinds
    assert kinds[RecordKind.MEMORY] == (made + 9) // 10  # the footprint's kinds are always on


def test_copies_are_off_by_default() -> None:
    assert ProbeSettings().copies == "off" and ProbeSettings.from_env({}).copies == "off"


@pytest.mark.parametrize("raw,expected", [("1", "always"), ("false", "off"), ("always", "always"),
                                          ("sometimes", "off")])
def test_copies_setting_reads_booleans_and_falls_back_on_nonsense(raw: str, expected: str) -> None:
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


def test_raw_delivery_that_cannot_register_falls_back_to_objects_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    class TwoLibcupti(fk.FakeRawCupti):
        """As on a machine where PyTorch and cupti-python map different libcupti files."""

        def __init__(self) -> None:
            super().__init__()
            self.errors.append("raw delivery: not exactly one libcupti mapped")

        def register_raw(self, delivery: Any) -> bool:
            return False

    fake = TwoLibcupti()
    probe = Probe(ProbeSettings(socket="", flush_ms=10), fake, discover_devices=False)
    with caplog.at_level("WARNING", logger="gpufootprint.probe.arming"):
        assert probe.start()
        try:
            fake.alloc(0x1000, 4096)
            probe.mark("m")
        finally:
            probe.stop()
    st = probe.status()
    assert st["delivery"] == "objects" and st["raw_delivery_unavailable"] == 1
    assert probe.sender.table.live_by_kind(0) == {"device": 4096}  # nothing lost on the way
    lines = [r.getMessage() for r in caplog.records if "raw delivery unavailable" in r.getMessage()]
    assert lines == [("gpufootprint probe: raw delivery unavailable (raw delivery: not exactly one libcupti mapped); "
                     "using cupti-python's record objects")]
