from __future__ import annotations

import numpy as np
from engine_support import DATA, MIB, dev, proc, replay_snapshots, snap
from gpufootprint.config import LeaksConfig
from gpufootprint.engines.leaks import LeakTracker
from gpufootprint.ingest.pipeline import LIVE_TABLE_DTYPE
from gpufootprint.records import MemoryKind

S = 1_000_000_000


def table(rows: list[tuple[int, int, int]]) -> np.ndarray:
    t = np.zeros(len(rows), LIVE_TABLE_DTYPE)
    for i, r in enumerate(rows):
        t[i] = r
    return t


def test_slow_leak_is_suspected_and_a_steady_process_is_not() -> None:
    # GIVEN a 20-minute replay: pid 5151 leaks 2 MiB every 2 s, pid 5252 holds 512 MiB of old weights, flat
    tracker = LeakTracker(LeaksConfig())
    first_suspect = None
    last = ()
    for s in replay_snapshots(DATA / "synth_leak.gfp.gz", live_tables=True):
        last = tracker.evaluate(s)
        if first_suspect is None and any(x.suspect for x in last):
            first_suspect = s.processes[0].as_of_ns
    by = {x.pid: x for x in last}
    assert by[5151].suspect and not by[5252].suspect
    assert abs(by[5151].growth_bytes_per_second - MIB) < 0.01 * MIB  # type: ignore[operator]
    # leaked blocks allocated at least 300 s before the end: seconds 0, 2, ..., 898 -> 450 of them, + the 64 MiB
    assert by[5151].old_allocations == 451
    assert by[5151].suspect_bytes == 450 * 2 * MIB + 64 * MIB
    assert by[5151].top_sites[0].label == "device:2097152B" and by[5151].top_sites[0].count == 450
    assert by[5252].suspect_bytes == 512 * MIB and "fail: footprint grows" in by[5252].reasons[1]
    # not before the trend window is half covered (300 s) and allocations are 300 s old
    assert first_suspect is not None
    start = 1_764_633_600_000_000_000 + 5 * S
    assert first_suspect - start >= 300 * S


def test_growth_without_old_allocations_is_not_a_leak() -> None:
    tracker = LeakTracker(LeaksConfig(min_age_seconds=60, growth_window_seconds=10, min_trend_points=3))
    for i in range(12):
        now = (100 + i) * S
        young = table([(now - S, (i + 1) * 8 * MIB, MemoryKind.DEVICE)])
        (st,) = tracker.evaluate(snap(float(i), proc(1, dev(0, (i + 1) * 8 * MIB, live_table=young), as_of_ns=now)))
    assert not st.suspect and st.suspect_bytes == 0 and st.growth_bytes_per_second == 8 * MIB


def test_static_module_globals_are_never_suspects() -> None:
    tracker = LeakTracker(LeaksConfig(min_age_seconds=1, growth_window_seconds=4, min_trend_points=3))
    for i in range(6):
        now = (100 + i) * S
        t = table([(S, 64 * MIB, MemoryKind.DEVICE_STATIC), (now, i * MIB, MemoryKind.DEVICE)])
        (st,) = tracker.evaluate(snap(float(i), proc(1, dev(0, 64 * MIB + i * MIB, live_table=t), as_of_ns=now)))
    assert st.suspect_bytes == 0 and not st.suspect


def test_exited_process_and_missing_live_tables() -> None:
    tracker = LeakTracker(LeaksConfig())
    assert tracker.evaluate(snap(1.0, proc(1, dev(0, 0), exited=True, as_of_ns=S))) == ()
    (st,) = tracker.evaluate(snap(1.0, proc(2, dev(0, MIB), as_of_ns=S)))
    assert not st.suspect and "ages unknown" in st.reasons[0]
    tracker.evaluate(snap(2.0))
    assert tracker.trends == {}  # history of processes that left is dropped


def test_process_exiting_mid_window_clears_suspicion() -> None:
    cfg = LeaksConfig(min_age_seconds=1, growth_window_seconds=4, min_trend_points=3, min_suspect_bytes=1)
    tracker = LeakTracker(cfg)
    for i in range(8):
        now = (100 + i) * S
        t = table([(S * 50, (i + 1) * MIB, MemoryKind.DEVICE)])
        (st,) = tracker.evaluate(snap(float(i), proc(1, dev(0, (i + 1) * MIB, live_table=t), as_of_ns=now)))
    assert st.suspect
    assert tracker.evaluate(snap(9.0, proc(1, dev(0, 0, live_table=table([])), exited=True, as_of_ns=109 * S))) == ()
