from __future__ import annotations

import itertools

import numpy as np
import pytest
from engine_support import DATA, GIB, MIB, dev, proc, replay_snapshots, snap
from gpufootprint.config import LeaksConfig
from gpufootprint.engines.leaks import LeakStatus, LeakTracker
from gpufootprint.footprint.device_snapshot import LIVE_TABLE_DTYPE
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
    # the growth began with the trace; leaked blocks at least 60 s old at the end: seconds 0, 2, ..., 1138
    # -> 570 of them, + the 64 MiB allocated at the start
    assert by[5151].old_allocations == 571
    assert by[5151].suspect_bytes == 570 * 2 * MIB + 64 * MIB
    assert by[5151].top_sites[0].label == "device:2097152B" and by[5151].top_sites[0].count == 570
    assert by[5252].suspect_bytes == 0 and "fail: footprint grows 0 B/s" in by[5252].reasons[0]
    # no verdict in the warm-up; the first once the trend covers most of its window
    assert first_suspect is not None
    start = 1_764_633_600_000_000_000 + 5 * S
    assert 120 * S <= first_suspect - start <= 300 * S


def test_growth_without_old_allocations_is_not_a_leak() -> None:
    tracker = LeakTracker(LeaksConfig(min_age_seconds=60, growth_window_seconds=10, min_trend_points=3,
                                      warmup_seconds=0))
    for i in range(12):
        now = (100 + i) * S
        young = table([(now - S, (i + 1) * 8 * MIB, MemoryKind.DEVICE)])
        (st,) = tracker.evaluate(snap(float(i), proc(1, dev(0, (i + 1) * 8 * MIB, live_table=young), as_of_ns=now)))
    assert not st.suspect and st.suspect_bytes == 0 and st.growth_bytes_per_second == 8 * MIB


def test_static_module_globals_are_never_suspects() -> None:
    tracker = LeakTracker(LeaksConfig(min_age_seconds=1, growth_window_seconds=4, min_trend_points=3,
                                      warmup_seconds=0, growth_segments=4))
    for i in range(6):
        now = (100 + i) * S
        t = table([(S, 64 * MIB, MemoryKind.DEVICE_STATIC), (now, i * MIB, MemoryKind.DEVICE)])
        (st,) = tracker.evaluate(snap(float(i), proc(1, dev(0, 64 * MIB + i * MIB, live_table=t), as_of_ns=now)))
    assert st.suspect_bytes == 0 and not st.suspect


def test_exited_process_and_missing_live_tables() -> None:
    # GIVEN a tracker fed snapshots without live tables: an exited process, then one whose footprint grows
    cfg = LeaksConfig(min_age_seconds=1, growth_window_seconds=4, min_trend_points=3, min_suspect_bytes=1,
                      warmup_seconds=0, growth_segments=4)
    tracker = LeakTracker(cfg)
    assert tracker.evaluate(snap(1.0, proc(1, dev(0, 0), exited=True, as_of_ns=S))) == ()
    (st,) = tracker.evaluate(snap(1.0, proc(2, dev(0, MIB), as_of_ns=100 * S)))
    # THEN before its growth has an onset no table is needed, none is asked for, and none is missed
    assert not st.suspect and not any("ages unknown" in r for r in st.reasons) and not tracker.wants_table(2, 0)
    for i in range(1, 8):
        (st,) = tracker.evaluate(snap(1.0 + i, proc(2, dev(0, (i + 1) * MIB), as_of_ns=(100 + i) * S)))
    # once it has one, a snapshot without its table is no verdict, says so, and the table is asked for
    assert not st.suspect and "ages unknown" in st.reasons[-1] and tracker.wants_table(2, 0)
    tracker.evaluate(snap(20.0))
    assert tracker.trends == {} and not tracker.wants_table(2, 0)  # history of processes that left is dropped


def test_process_exiting_mid_window_clears_suspicion() -> None:
    cfg = LeaksConfig(min_age_seconds=1, growth_window_seconds=4, min_trend_points=3, min_suspect_bytes=1,
                      warmup_seconds=0, growth_segments=4)
    tracker = LeakTracker(cfg)
    rows: list[tuple[int, int, int]] = []
    for i in range(8):
        now = (100 + i) * S
        rows.append((now, MIB, MemoryKind.DEVICE))
        (st,) = tracker.evaluate(snap(float(i), proc(1, dev(0, (i + 1) * MIB, live_table=table(rows)),
                                                     as_of_ns=now)))
    assert st.suspect
    assert tracker.evaluate(snap(9.0, proc(1, dev(0, 0, live_table=table([])), exited=True, as_of_ns=109 * S))) == ()


# --- time-stretched scenarios: a real pipeline (live tables on) fed minute after minute of records ----


def run_scenario(events: list[tuple[float, int, int]], minutes: float, *, tick_s: float = 1.0,
                 cfg: LeaksConfig | None = None, on_demand: bool = False,
                 tables: list[bool] | None = None) -> list[tuple[float, LeakStatus]]:
    """``events``: (second, +bytes to allocate / -bytes to free, address). Returns each tick's verdict.
    ``on_demand``: the pipeline builds live tables only for the devices the tracker asks for, as the daemon's
    does; ``tables`` gets, per tick, whether the snapshot carried the live table."""
    from gpufootprint.config import FootprintConfig
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.records import MEMORY_DTYPE, RecordKind

    pipeline = Pipeline(FootprintConfig())
    pipeline.snapshot_live_tables = True
    pipeline.process(9, "probe")
    tracker = LeakTracker(cfg or LeaksConfig())
    if on_demand:
        pipeline.live_table_wanted = tracker.wants_table
    t0 = 10**12
    events = sorted(events)
    out: list[tuple[float, LeakStatus]] = []
    fed = 0
    steps = int(minutes * 60 / tick_s)
    for k in range(1, steps + 1):
        now = k * tick_s
        batch = [e for e in events[fed:] if e[0] < now]
        fed += len(batch)
        if batch:
            recs = np.zeros(len(batch), MEMORY_DTYPE)
            for i, (sec, delta, addr) in enumerate(batch):
                recs[i]["ts"], recs[i]["op"], recs[i]["addr"] = t0 + int(sec * S), 1 if delta > 0 else 2, addr
                recs[i]["bytes"], recs[i]["mk"], recs[i]["pid"] = abs(delta), MemoryKind.DEVICE, 9
            pipeline.submit(RecordKind.MEMORY, recs)
        pipeline.advance(9, t0 + int(now * S))
        snapshot = pipeline.snapshot(wall_time=now)
        if tables is not None:
            tables.append(snapshot.processes[0].devices[0].live_table is not None)
        (st,) = tracker.evaluate(snapshot)
        out.append((now, st))
    return out


def test_start_up_step_then_flat_for_15_minutes_is_never_suspected() -> None:
    # 1 GiB at start, 256 MiB a minute later (the 2026-12-03 report: "leak suspected ... 762239 B/s")
    events = [(0.5, GIB, 0x1000_0000), (60.0, 256 * MIB, 0x9000_0000)]
    verdicts = run_scenario(events, 15)
    assert not [t for t, st in verdicts if st.suspect]
    assert verdicts[30][1].reasons[0].startswith("warm-up")  # no verdict at 31 s
    assert "rising in 1 of 7 segments" in verdicts[239][1].reasons[0]  # the 60 s step, in the window at 240 s


def test_real_start_up_stretched_to_minutes_then_flat_is_never_suspected() -> None:
    # the H200 caching trace's device allocations and frees (4.2 s) stretched 60x: 4 minutes of
    # start-up climbing to 772 MiB and back to 278 MiB, then flat to 15 minutes
    import gzip
    import json

    lines = [json.loads(x) for x in gzip.decompress((DATA / "h200_caching.jsonl.gz").read_bytes()).splitlines()]
    mem = [o for o in lines if o["k"] == "mem" and o["mk"] == 3]
    t0 = mem[0]["ts"]
    events = [((o["ts"] - t0) / 1e9 * 60 + 0.5, o["bytes"] if o["op"] == 1 else -o["bytes"], o["addr"]) for o in mem]
    verdicts = run_scenario(events, 15)
    assert not [t for t, st in verdicts if st.suspect]


def test_steady_leak_of_1_mib_per_second_is_suspected_within_5_minutes_of_its_start() -> None:
    # 2 GiB of weights at start, flat for 5 minutes, then 1 MiB leaked every second
    events = [(0.5, 2 * GIB, 0x1000_0000)] + [(300.0 + i, MIB, 0x8_0000_0000 + i * MIB) for i in range(600)]
    verdicts = run_scenario(events, 15)
    first = next(t for t, st in verdicts if st.suspect)
    assert 300 < first <= 300 + 300, first
    st = verdicts[-1][1]
    assert st.suspect and st.growth_bytes_per_second == pytest.approx(MIB, rel=0.05)
    # the suspects are the leaked blocks, not the weights loaded before the growth began
    assert st.top_sites[0].label == "device:1048576B" and all(s.bytes_each == MIB for s in st.top_sites)
    assert not [t for t, s in verdicts if s.suspect and t < 300]


def test_live_tables_built_on_demand_only_once_growth_has_an_onset_and_the_verdict_one_snapshot_later() -> None:
    # GIVEN the steady leak above, judged with every live table built and with the daemon's on-demand tables
    events = [(0.5, 2 * GIB, 0x1000_0000)] + [(300.0 + i, MIB, 0x8_0000_0000 + i * MIB) for i in range(600)]
    every = run_scenario(events, 15)
    built: list[bool] = []
    on_demand = run_scenario(events, 15, on_demand=True, tables=built)
    # THEN no table is built before the growth has an onset, and every snapshot carries one after it
    onset_tick = next(i for i, (_, st) in enumerate(on_demand) if any("ages unknown" in r for r in st.reasons))
    assert not any(built[:onset_tick + 1]) and all(built[onset_tick + 1:])
    assert 300 < on_demand[onset_tick][0] < 600
    # and the verdicts are the same, one snapshot later at the onset
    first_every = next(i for i, (_, st) in enumerate(every) if st.suspect)
    first_on_demand = next(i for i, (_, st) in enumerate(on_demand) if st.suspect)
    assert first_on_demand in (first_every, first_every + 1)
    assert [st.suspect for _, st in every[first_every + 1:]] == [st.suspect for _, st in on_demand[first_every + 1:]]
    assert every[-1][1] == on_demand[-1][1]


def test_a_growth_that_passes_only_every_other_snapshot_is_judged_at_each_pass_with_tables_on_demand() -> None:
    # GIVEN a 1 MiB/s leak with 64 MiB held on even seconds only, its slope at the threshold: the growth test
    # passes and fails by turns (review 34 found the on-demand tables then missing at almost every pass)
    events: list[tuple[float, int, int]] = [(sec - 0.5, MIB, 0x8_0000_0000 + sec * MIB) for sec in range(1, 900)]
    events += [(sec - 0.4, 64 * MIB if sec % 2 == 0 else -64 * MIB, 0x1_0000_0000) for sec in range(2, 900)]
    cfg = LeaksConfig(growth_window_seconds=239.5, min_growth_bytes_per_second=MIB, min_suspect_bytes=1)
    every = [st.suspect for _, st in run_scenario(events, 15, cfg=cfg)]
    on_demand = [st.suspect for _, st in run_scenario(events, 15, cfg=cfg, on_demand=True)]
    # THEN it flips, and is suspected at the same snapshots but the first
    assert sum(a != b for a, b in itertools.pairwise(every)) > 100
    first = every.index(True)
    assert on_demand[first + 1:] == every[first + 1:] and sum(on_demand) >= sum(every) - 1


def test_tables_stop_being_asked_for_a_growth_window_after_the_growth_stops() -> None:
    cfg = LeaksConfig(min_age_seconds=1, growth_window_seconds=4, min_trend_points=3, min_suspect_bytes=1,
                      warmup_seconds=0, growth_segments=4)
    tracker = LeakTracker(cfg)
    asked = []
    for i in range(20):
        size = (min(i, 8) + 1) * MIB  # grows for 8 s, then flat
        tracker.evaluate(snap(float(i), proc(1, dev(0, size), as_of_ns=(100 + i) * S)))
        asked.append(tracker.wants_table(1, 0))
    # asked for while it grows and for one window (4 s) after its last onset, then no more
    assert any(asked[:9]) and not any(asked[16:])
    last_onset = max(i for i in range(9) if asked[i]) if any(asked[:9]) else 0
    assert all(asked[last_onset:min(20, last_onset + 4)])


def test_spiky_training_with_a_growing_cache_is_never_suspected() -> None:
    # 4 GiB of weights; each 2 s step allocates 1-3 GiB of activations and frees them; a caching
    # allocator's extra segments arrive in steps over the first 90 s; 15 minutes
    import random

    rng = random.Random(7)
    events: list[tuple[float, int, int]] = [(0.5, 4 * GIB, 0x1000_0000)]
    for j in range(6):
        events.append((10.0 + 15 * j, 128 * MIB, 0x2000_0000 + j * GIB))
    for step in range(450):
        t = 1.0 + 2 * step
        n = rng.randint(4, 12)
        for b in range(n):
            events.append((t + 0.05 * b, 256 * MIB, 0x4_0000_0000 + b * GIB))
        for b in range(n):
            events.append((t + 1.0 + 0.05 * b, -256 * MIB, 0x4_0000_0000 + b * GIB))
    verdicts = run_scenario(events, 15, tick_s=0.7)
    assert not [t for t, st in verdicts if st.suspect]


def test_a_device_growing_slower_than_the_threshold_is_judged_without_walking_its_floors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN 6 minutes at one snapshot a second: a process flat at 1 GiB, then one growing 32 KiB a minute
    # (about 546 B/s, under the 1,024 B/s threshold), then one growing 1 MiB every 2 s (above it)
    from gpufootprint.engines import leaks

    walks: list[int] = []
    real = leaks._rising_floors

    def counted(trend, window, segments):  # type: ignore[no-untyped-def]
        walks.append(len(trend))
        return real(trend, window, segments)

    monkeypatch.setattr(leaks, "_rising_floors", counted)
    flat = run_scenario([(0.5, GIB, 0x1000)], 6)
    slow = run_scenario([(0.5, GIB, 0x1000)] + [(60.0 * m, 32 * 1024, 0x2000 + m) for m in range(1, 6)], 6)
    assert walks == []
    # THEN neither walked its floors, and the reason says why it fails: the slope and the threshold
    for verdicts in (flat, slow):
        last = verdicts[-1][1]
        assert not last.suspect
        assert last.reasons == (f"fail: footprint grows {last.growth_bytes_per_second:.0f} B/s (threshold 1024 B/s)",)
    assert 0 < slow[-1][1].growth_bytes_per_second < 1024  # type: ignore[operator]
    # AND a device above the threshold is walked at each snapshot past the warm-up and reports its segments
    fast = run_scenario([(0.5, GIB, 0x1000)] + [(2.0 * k, MIB, 0x3000 + k) for k in range(1, 180)], 6)
    assert walks and "segments" in fast[-1][1].reasons[0]


def test_a_slope_exactly_at_the_threshold_is_judged_on_its_floors() -> None:
    # GIVEN 1,024 B allocated every second, judged every second: the slope is 1,024 B/s exactly, the threshold
    events = [(float(k) - 0.5, 1024, 0x4000 + k) for k in range(1, 400)]
    verdicts = run_scenario(events, 6, cfg=LeaksConfig(min_suspect_bytes=1))
    last = verdicts[-1][1]
    # THEN it reaches the floors (at the threshold passes) and, rising in every segment, is a suspect
    assert last.growth_bytes_per_second == 1024.0
    assert "rising in 7 of 7 segments" in last.reasons[0] and last.suspect
