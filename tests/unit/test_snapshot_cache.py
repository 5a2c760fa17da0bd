"""A device's snapshot is kept while its table, its watermark and its live table stay as they were: at
every frame of real recordings (memory, pools, copies, memsets, kernels, managed memory, restarts, resyncs,
failed allocations), the kept snapshot equals one built afresh."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpufootprint.config import FootprintConfig
from gpufootprint.footprint.device_snapshot import device_snapshot
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file
from gpufootprint.wire.framing import Frame

DATA = Path(__file__).resolve().parents[1] / "data"
TRACES = ["h200_probe_async.gfp.gz", "h200_probe_pinned_managed.gfp.gz", "h200_kernels_train.gfp.gz",
          "h200_probe_restart.gfp.gz", "h200_probe_profiler.gfp.gz", "h200_survive_oom_torch.gfp.gz",
          "h100_native_probe_churn_nocache.gfp.gz", "synth_leak.gfp.gz"]


def _same(kept: Any, fresh: Any) -> bool:
    """Two snapshots (or features) of one dataclass equal field by field, arrays by their values."""
    for f in dataclasses.fields(kept):
        a, b = getattr(kept, f.name), getattr(fresh, f.name)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            if a is None or b is None or not np.array_equal(a, b):
                return False
        elif a != b:
            return False
    return True


@pytest.mark.parametrize("trace", TRACES)
def test_a_kept_device_snapshot_equals_one_built_afresh_at_every_frame(trace: str) -> None:
    pipeline = Pipeline(FootprintConfig())
    pipeline.snapshot_live_tables = True  # the live tables too, as the leak engine asks for them
    seen = {"snapshots": 0, "kept": 0}

    def check(_frame: Frame) -> None:
        before = {(pid, dev): entry[3] for pid, proc in pipeline.processes.items()
                  for dev, entry in proc.device_snapshots.items()}
        snap = pipeline.snapshot(0.0)
        for p in snap.processes:
            proc = pipeline.processes[p.pid]
            for d in p.devices:
                fp = proc.devices[d.dev]
                fresh = device_snapshot(fp, proc.applied_to, pipeline._window_ns, d.live_table)
                assert _same(d, fresh), (trace, p.pid, d.dev)
                seen["snapshots"] += 1
                seen["kept"] += before.get((p.pid, d.dev)) is d

    replay_file(DATA / trace, pipeline, on_frame=check)
    assert seen["snapshots"] > 0
    assert 0 < seen["kept"] < seen["snapshots"], seen  # both paths taken: kept between changes, built at them


def test_records_applied_without_a_watermark_show_in_the_next_snapshot() -> None:
    """Late records are applied at once, the watermark where it was: only the table's count of changes says
    the kept snapshot is stale."""
    from gpufootprint.records import MEMORY_DTYPE, MemoryKind, RecordKind

    pipeline = Pipeline(FootprintConfig())
    pipeline.process(7, "probe")

    def allocation(ts: int, addr: int, size: int) -> np.ndarray:
        rec = np.zeros(1, MEMORY_DTYPE)
        rec["ts"], rec["addr"], rec["bytes"], rec["pid"], rec["op"], rec["mk"] = ts, addr, size, 7, 1, MemoryKind.DEVICE
        return rec

    pipeline.submit(RecordKind.MEMORY, allocation(1_000, 0x1000, 4096))
    pipeline.watermark(7, 10_000)
    pipeline.advance(7, 10_000)
    first = pipeline.snapshot(0.0).processes[0].devices[0]
    assert first.live_bytes == {"device": 4096}
    assert pipeline.snapshot(0.0).processes[0].devices[0] is first  # nothing changed: kept
    applied_to = pipeline.processes[7].applied_to
    pipeline.submit(RecordKind.MEMORY, allocation(2_000, 0x2000, 8192))  # stamped before the watermark: late
    assert pipeline.processes[7].applied_to == applied_to and pipeline.late_records == 1
    assert pipeline.snapshot(0.0).processes[0].devices[0].live_bytes == {"device": 12288}


def test_every_method_that_changes_a_device_table_is_counted() -> None:
    """A kept snapshot is right only if every change to the table is counted: each public method of
    ``DeviceFootprint`` is a counted change (``_changes``) or one of the few that only read."""
    import inspect

    from gpufootprint.footprint.table import DeviceFootprint

    reading = {"live_counts"}
    for name, member in inspect.getmembers(DeviceFootprint, inspect.isfunction):
        if name.startswith("_") or name in reading:
            continue
        assert hasattr(member, "__wrapped__"), f"DeviceFootprint.{name} changes the table uncounted?"


def test_a_watermark_alone_moves_the_window_peak_in_the_next_snapshot() -> None:
    """No record for a minute, only watermarks: the spike leaves the window (``window_peak_seconds``), so a
    snapshot kept from before it would still show it."""
    from gpufootprint.records import MEMORY_DTYPE, MemoryKind, RecordKind

    pipeline = Pipeline(FootprintConfig())
    pipeline.process(7, "probe")
    s = 1_000_000_000
    recs = np.zeros(2, MEMORY_DTYPE)
    recs["ts"], recs["addr"], recs["bytes"], recs["pid"], recs["mk"] = [1 * s, 2 * s], 0x1000, 1 << 30, 7, MemoryKind.DEVICE
    recs["op"] = [1, 2]
    pipeline.submit(RecordKind.MEMORY, recs)
    pipeline.watermark(7, 3 * s)
    pipeline.advance(7, 3 * s)
    assert pipeline.snapshot(0.0).processes[0].devices[0].window_peak_bytes == 1 << 30
    later = 3 * s + int(FootprintConfig().window_peak_seconds * s) + 2 * s
    pipeline.watermark(7, later)
    pipeline.advance(7, later)
    assert pipeline.processes[7].devices[0].changes == pipeline.processes[7].device_snapshots[0][0]  # no change
    assert pipeline.snapshot(0.0).processes[0].devices[0].window_peak_bytes == 0


def test_a_device_whose_live_table_is_wanted_now_gets_it_in_the_next_snapshot() -> None:
    """The leak engine asks for the live tables of growing devices only: a device asked for now, unchanged
    since the last tick, must come with its table, not the kept snapshot without one."""
    from gpufootprint.records import MEMORY_DTYPE, MemoryKind, RecordKind

    pipeline = Pipeline(FootprintConfig())
    pipeline.process(7, "probe")
    pipeline.snapshot_live_tables = True
    wanted: set[tuple[int, int]] = set()
    pipeline.live_table_wanted = lambda pid, dev: (pid, dev) in wanted
    rec = np.zeros(1, MEMORY_DTYPE)
    rec["ts"], rec["addr"], rec["bytes"], rec["pid"], rec["op"], rec["mk"] = 1_000, 0x1000, 4096, 7, 1, MemoryKind.DEVICE
    pipeline.submit(RecordKind.MEMORY, rec)
    pipeline.watermark(7, 10_000)
    pipeline.advance(7, 10_000)
    assert pipeline.snapshot(0.0).processes[0].devices[0].live_table is None
    wanted.add((7, 0))
    table = pipeline.snapshot(0.0).processes[0].devices[0].live_table
    assert table is not None and len(table) == 1 and int(table["bytes"][0]) == 4096
    wanted.clear()
    assert pipeline.snapshot(0.0).processes[0].devices[0].live_table is None


@pytest.mark.parametrize("trace", TRACES)
def test_kept_device_features_equal_ones_built_afresh_at_every_frame(trace: str) -> None:
    """The feature hub keeps a device's features while its frames and counters, its sampler's steps, the
    watermark and the pool figures stay as they were: at every frame each equals one built afresh."""
    from gpufootprint.hub import FeatureHub

    hub = FeatureHub()
    pipeline = Pipeline(FootprintConfig(), hub=hub)
    seen = {"features": 0, "kept": 0}
    last: dict[tuple[int, int], object] = {}

    def check(_frame: Frame) -> None:
        snap = pipeline.snapshot(0.0)
        for f in snap.features:
            proc = pipeline.processes[f.pid]
            fp = proc.devices[f.dev]
            fresh = hub._device_features(hub.builders[(f.pid, f.dev)], hub.samplers.get(f.pid), f.pid, f.dev,
                                         proc.applied_to, fp.pool_reserved_bytes, fp.async_device_bytes)
            assert type(f) is type(fresh) and _same(f, fresh), (trace, f.pid, f.dev, f, fresh)
            seen["features"] += 1
            seen["kept"] += last.get((f.pid, f.dev)) is f
            last[(f.pid, f.dev)] = f

    replay_file(DATA / trace, pipeline, on_frame=check)
    assert 0 < seen["kept"] < seen["features"], seen  # both paths taken: kept between changes, built at them


def test_every_method_that_changes_a_frame_builder_is_counted() -> None:
    """Kept features are right only if every change to what they read is counted: each public method of
    ``FrameBuilder`` is a counted change (``_changes``) or one of those that only read."""
    import inspect

    from gpufootprint.features.frames import FrameBuilder

    reading = {"frames", "migration_windows", "recent_migration_windows", "migration_rate_hz"}
    for name, member in inspect.getmembers(FrameBuilder, inspect.isfunction):
        if name.startswith("_") or name in reading:
            continue
        assert hasattr(member, "__wrapped__"), f"FrameBuilder.{name} changes the features uncounted?"


def test_a_heartbeats_torch_figures_and_a_watermark_alone_show_in_the_next_features() -> None:
    """Allocator slack comes from a heartbeat, not from records; the sampler's last peak moves at a watermark
    that brings no record: each shows in the next snapshot's features, not in the kept ones."""
    from gpufootprint.hub import FeatureHub
    from gpufootprint.records import MEMORY_DTYPE, MemoryKind, RecordKind

    hub = FeatureHub()
    pipeline = Pipeline(FootprintConfig(), hub=hub)
    pipeline.process(7, "probe")
    rec = np.zeros(1, MEMORY_DTYPE)
    rec["ts"], rec["addr"], rec["bytes"], rec["pid"], rec["op"], rec["mk"] = 1_000, 0x1000, 1 << 30, 7, 1, MemoryKind.DEVICE
    pipeline.submit(RecordKind.MEMORY, rec)
    pipeline.watermark(7, 2_000)
    pipeline.advance(7, 2_000)
    first = pipeline.snapshot(0.0).features[0]
    assert pipeline.snapshot(0.0).features[0] is first  # nothing changed: kept
    pipeline.note_torch(7, {"allocated": {"0": 1 << 20}, "reserved": {"0": 3 << 20}})
    slack = pipeline.snapshot(0.0).features[0]
    assert slack.allocator_slack_bytes == 2 << 20 and first.allocator_slack_bytes is None
    steps = hub.samplers[7].steps
    pipeline.watermark(7, 10**9)  # a second later, no record: the sampler closes intervals, its peak is the level
    pipeline.advance(7, 10**9)
    assert hub.samplers[7].steps > steps
    later = pipeline.snapshot(0.0).features[0]
    assert later is not slack and later.frame_peak_bytes == 1 << 30


def test_each_part_of_what_kept_features_are_made_of_renews_them() -> None:
    """Through the hub alone, each part of the key moved on its own: the sampler's steps (its last peak), the
    watermark the migration rate is read as of, the pool figures. Each gives features built afresh."""
    from gpufootprint.features.frames import UmCounterKind
    from gpufootprint.footprint.peaks import FramePeaks, LevelChanges
    from gpufootprint.hub import FeatureHub
    from gpufootprint.records import UNIFIED_MEMORY_DTYPE, RecordKind

    hub = FeatureHub()
    hub.open_device(7, 0, FramePeaks(5_000_000, 60 * 10**9))
    ms = 1_000_000
    hub.on_levels(7, 0, LevelChanges(np.array([1 * ms], np.uint64), np.array([1 << 30], np.int64), 1 << 30))
    um = np.zeros(1, UNIFIED_MEMORY_DTYPE)
    um["start"], um["end"], um["value"], um["pid"], um["ck"] = 2 * ms, 3 * ms, 4096, 7, UmCounterKind.BYTES_TRANSFER_HTOD
    hub.on_records(7, 0, RecordKind.UNIFIED_MEMORY, um)
    window_ns = hub.builders[(7, 0)].migration_ns
    as_of = window_ns + 5 * ms  # the window with the transfer just closed

    first = hub.device_features(7, 0, as_of, 100, 50)
    assert first is not None and first.migration_rate_hz and first.pool_utilization_ratio == 0.5
    assert hub.device_features(7, 0, as_of, 100, 50) is first
    # The watermark alone: a later window, closed without transfers.
    later = hub.device_features(7, 0, as_of + 3 * window_ns, 100, 50)
    assert later is not None and later.migration_rate_hz == 0.0
    # The pool figures alone.
    pool = hub.device_features(7, 0, as_of + 3 * window_ns, 100, 80)
    assert pool is not None and pool.pool_utilization_ratio == 0.8
    # The sampler's steps alone: its peak of the last closed interval, at the same watermark.
    assert pool.frame_peak_bytes != 1 << 30
    hub.on_watermark(7, 2 * window_ns, "probe")
    stepped = hub.device_features(7, 0, as_of + 3 * window_ns, 100, 80)
    assert stepped is not None and stepped.frame_peak_bytes == 1 << 30
