"""Ordering, repair and self-verification in the pipeline (the daemon's side of exactness under churn)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gpufootprint.config import FootprintConfig
from gpufootprint.configload import load_config
from gpufootprint.footprint.peaks import FramePeaks
from gpufootprint.ingest.session import Session
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import MemoryKind, RecordKind
from gpufootprint.replay import replay_file
from gpufootprint.wire import framing
from gpufootprint.wire.framing import FrameType, iter_frames

from tests.conftest import ALLOC, FREE, mem, mem_batch

MS = 1_000_000
DEV = int(MemoryKind.DEVICE)
DATA = Path(__file__).resolve().parents[1] / "data"


def pipeline() -> Pipeline:
    return Pipeline(FootprintConfig())


def test_a_watermarked_stream_is_not_advanced_by_its_newest_record() -> None:
    """A busy thread's new records must not push the watermark past a quiet thread's older ones."""
    p = pipeline()
    p.process(100, "probe")
    p.watermark(100, 1_000 * MS)
    p.submit(RecordKind.MEMORY, mem_batch([mem(1_001 * MS, ALLOC, 0xA, 4096)]))
    # the busy thread: 5 s later, far beyond the 500 ms reorder window
    p.submit(RecordKind.MEMORY, mem_batch([mem(6_000 * MS, ALLOC, 0xB, 4096)]))
    assert p.processes[100].applied_to == 1_000 * MS
    # the quiet thread's release of 0xA, stamped before the reuse below, arrives now
    p.submit(RecordKind.MEMORY, mem_batch([mem(2_000 * MS, FREE, 0xA, 4096),
                                           mem(3_000 * MS, ALLOC, 0xA, 8192)]))
    p.watermark(100, 7_000 * MS)
    assert p.late_records == 0 and dict(p.errors.counts) == {}
    assert p.processes[100].devices[0].live_by_kind[DEV] == 4096 + 8192


def test_without_watermarks_the_reorder_window_still_advances_a_trace() -> None:
    p = pipeline()
    p.submit(RecordKind.MEMORY, mem_batch([mem(1_000 * MS, ALLOC, 0xA, 4096)]))
    p.submit(RecordKind.MEMORY, mem_batch([mem(6_000 * MS, ALLOC, 0xB, 4096)]))
    assert p.processes[100].applied_to == 5_500 * MS


def test_a_late_record_is_applied_counted_and_asks_for_a_resync_that_repairs_the_state() -> None:
    p = pipeline()
    proc = p.process(100, "probe")
    p.submit(RecordKind.MEMORY, mem_batch([mem(100, ALLOC, 0xA, 4096)]))
    p.watermark(100, 200)
    # a hung CUPTI thread: the release of 0xA and its reuse, stamped before the watermark
    p.submit(RecordKind.MEMORY, mem_batch([mem(150, FREE, 0xA, 4096)]))
    assert p.late_records == 1 and proc.late_records == 1
    assert p.resync_wanted == {100}
    # the probe's table as of its watermark replaces ours; records stamped later still apply
    p.submit(RecordKind.MEMORY, mem_batch([mem(300, ALLOC, 0xC, 1024)]))
    p.resync(100, mem_batch([mem(120, ALLOC, 0xB, 8192)]), 200)
    p.watermark(100, 400)
    assert proc.devices[0].live_by_kind[DEV] == 8192 + 1024
    assert set(proc.devices[0].live) == {0xB, 0xC}


def test_a_resync_rewinds_a_state_that_ran_ahead_so_records_sent_again_are_not_late() -> None:
    """After a reconnect the probe sends its table as of its watermark, then again the records
    stamped after it, which the daemon had already applied when the old connection ended."""
    p = pipeline()
    proc = p.process(100, "probe")
    p.watermark(100, 100)
    p.submit(RecordKind.MEMORY, mem_batch([mem(150, ALLOC, 0xA, 4096)]))
    p.finish(100)  # the connection ended: everything applied
    assert proc.applied_to >= 150
    p.resync(100, mem_batch([]), 100)
    p.submit(RecordKind.MEMORY, mem_batch([mem(150, ALLOC, 0xA, 4096)]))
    p.watermark(100, 200)
    assert p.late_records == 0 and dict(p.errors.counts) == {}
    assert proc.devices[0].live_by_kind[DEV] == 4096


def test_verify_matches_the_probes_totals_and_measures_and_logs_a_drift(caplog) -> None:  # type: ignore[no-untyped-def]
    p = pipeline()
    proc = p.process(100, "probe")
    p.submit(RecordKind.MEMORY, mem_batch([mem(100, ALLOC, 0xA, 4096), mem(110, ALLOC, 0xB, 100, kind=2)]))
    p.watermark(100, 200)
    assert p.verify(100, 200, {0: {DEV: (4096, 1), 2: (100, 1)}}) == "match"
    assert proc.drift_bytes == 0 and proc.drift_checks == 1
    # the probe holds 1 MiB more than we do (a batch lost on the way)
    assert p.verify(100, 200, {0: {DEV: (4096 + (1 << 20), 2), 2: (100, 1)}}) == "mismatch"
    assert proc.drift_bytes == 1 << 20 and proc.drift_mismatches == 1
    assert p.resync_wanted == {100}
    assert sum("footprint drift pid=100" in r.message for r in caplog.records) == 1
    p.verify(100, 200, {0: {}})
    assert sum("footprint drift" in r.message for r in caplog.records) == 1  # logged once per process
    # not as of the same time: not compared
    assert p.verify(100, 150, {0: {}}) == "skipped"


def test_totals_frames_reach_verify_through_the_session_and_bad_ones_are_counted() -> None:
    p = pipeline()
    s = Session(p, source="probe", name="probe pid=100", peer_pid=100)
    frames = framing.PREAMBLE + framing.encode_json(FrameType.HELLO, {"pid": 100})
    frames += framing.encode_batch(RecordKind.MEMORY, mem_batch([mem(100, ALLOC, 0xA, 4096)]))
    frames += framing.encode_watermark(200)
    frames += framing.encode_json(FrameType.TOTALS, {"ts": 200, "pid": 100, "devices": {"0": {str(DEV): [4096, 1]}}})
    frames += framing.encode_json(FrameType.TOTALS, {"ts": 200, "pid": 100, "devices": {"0": {str(DEV): [-1, 1]}}})
    frames += framing.encode_json(FrameType.TOTALS, {"ts": 200, "pid": 999, "devices": {}})
    for f in iter_frames([frames]):
        s.handle(f)
    assert p.verify_results["match"] == 1
    assert p.errors.counts["bad_totals"] == 2


def test_a_late_spike_is_still_the_window_peak() -> None:
    """A record applied late lands in a frame older than the open one; the window must still see it."""
    peaks = FramePeaks(10 * MS, 60_000 * MS)
    peaks.add(np.array([1_000 * MS]), np.array([8192]))
    peaks.add(np.array([5_000 * MS]), np.array([0]))
    peaks.add(np.array([9_000 * MS]), np.array([0]))
    # a 1 GiB spike at 3 s, applied late
    peaks.add(np.array([3_000 * MS, 3_001 * MS]), np.array([1 << 30, -(1 << 30)]))
    assert peaks.window_peak(9_000 * MS, 60_000 * MS) == (1 << 30) + 8192
    assert [f for f, _ in peaks.frames()] == sorted(f for f, _ in peaks.frames())
    assert peaks.level == 8192 and peaks.late_frames == 1


def test_a_late_spike_through_the_pipeline_is_the_exported_window_peak() -> None:
    p = pipeline()
    p.submit(RecordKind.MEMORY, mem_batch([mem(1_000 * MS, ALLOC, 0xA, 8192)]))
    p.watermark(100, 2_000 * MS)
    p.submit(RecordKind.MEMORY, mem_batch([mem(5_000 * MS, ALLOC, 0xC, 512)]))
    p.watermark(100, 9_000 * MS)
    p.submit(RecordKind.MEMORY, mem_batch([mem(1_500 * MS, ALLOC, 0xB, 1 << 30),
                                           mem(1_501 * MS, FREE, 0xB, 1 << 30)]))
    (proc,) = p.snapshot().processes
    assert proc.devices[0].window_peak_bytes >= 1 << 30
    assert proc.devices[0].device_bytes == 8192 + 512


def test_pool_reserved_is_never_below_pool_used_on_the_h200_async_trace() -> None:
    p = Pipeline(load_config(env={}).footprint)
    result = replay_file(DATA / "h200_probe_async.gfp.gz", p)
    marks = {m["label"]: m for m in result.marks}
    for label, m in marks.items():
        assert m["pool_reserved_bytes"] >= m.get("torch_memory_allocated", 0) or label == "after_mlp_steps", label
    # exact where CUPTI reported the size (a trim, the pool's creation), a bound (>= used) between
    assert marks["allocated"]["pool_reserved_bytes"] == marks["allocated"]["torch_memory_allocated"] == 676_188_640
    assert marks["freed_some"]["pool_reserved_bytes"] == marks["freed_some"]["torch_memory_reserved"]
    assert marks["empty_cache"]["pool_reserved_bytes"] == marks["empty_cache"]["torch_memory_reserved"]
    snap = p.snapshot()
    for proc in snap.processes:
        for d in proc.devices:
            assert d.pool_reserved_bytes >= d.pool_used_bytes


def test_a_watermarked_stream_that_stops_sending_watermarks_cannot_hold_records_back_without_bound() -> None:
    p = pipeline()
    p.max_pending_records = 1_000
    p.process(100, "probe")
    p.watermark(100, 1)
    rows = [mem(10 * MS + i * MS, ALLOC if i % 2 == 0 else FREE, 0x1000 + (i // 2) * 64, 64) for i in range(3_000)]
    for i in range(0, len(rows), 100):
        p.submit(RecordKind.MEMORY, mem_batch(rows[i:i + 100]))
    assert p.processes[100].pending_records <= 1_100
    assert p.pending_overflows >= 1


def test_advance_applies_exactly_the_due_records_in_time_then_arrival_order() -> None:
    """Random chunks, overlapping in time, and random watermarks: each advance applies every waiting record
    stamped at or before it, stably sorted by time (equal times in arrival order), and nothing else."""
    from gpufootprint.records import MEMCPY_DTYPE

    rng = np.random.default_rng(11)
    for trial in range(20):
        p = pipeline()
        p.process(7, "probe").watermarked = True
        applied: list[int] = []
        p.hub.taps.append(lambda pid, dev, kind, recs, applied=applied: applied.extend(recs["corr"].tolist()))
        waiting: list[tuple[int, int]] = []  # (time, arrival number) of records not yet applied
        corr = 0
        wm = 0
        for _ in range(60):
            if rng.random() < 0.7:
                n = int(rng.integers(1, 20))
                recs = np.zeros(n, MEMCPY_DTYPE)
                recs["start"] = wm + 1 + rng.integers(0, 200, n)  # never late: after the watermark
                recs["end"] = recs["start"] + 5
                recs["pid"] = 7
                recs["corr"] = np.arange(corr, corr + n)
                waiting.extend(zip(recs["start"].tolist(), range(corr, corr + n)))
                corr += n
                p.submit(RecordKind.MEMCPY, recs)
            else:
                wm += int(rng.integers(0, 120))
                before = len(applied)
                p.watermark(7, wm)
                due = sorted((t, c) for t, c in waiting if t <= wm)
                waiting = [(t, c) for t, c in waiting if t > wm]
                assert applied[before:] == [c for _, c in due], trial
        assert p.late_records == 0


def _state(p: Pipeline) -> tuple[object, ...]:
    proc = p.processes[7]
    tables = {dev: (sorted(fp.live.items()), list(fp.live_by_kind), fp.peaks.window_peak(proc.applied_to, 10**9))
              for dev, fp in sorted(proc.devices.items())}
    sampler = p.hub.samplers.get(7)
    # A window's device is the one that moved most in the part of the interval known when it opened, which
    # depends on where the watermarks fell (a live daemon's watermarks fall where the probe's flushes do):
    # its times and reason do not.
    windows = [(w.start_ns, w.end_ns, w.reason) for w in p.hub.windows]
    return (proc.applied_to, tables, p.late_records, dict(p.errors.counts),
            sampler.intervals() if sampler is not None else None,
            windows, dict(p.verify_results), proc.pending_records)


def test_coalesced_watermarks_leave_the_state_that_applying_each_at_once_leaves() -> None:
    """A busy daemon lets a probe's watermarks wait and applies several flushes as one: the footprint, the
    late count, verification and the sampler then read as if every watermark had been applied when it came."""
    rng = np.random.default_rng(5)
    for trial in range(8):
        now = [0.0]
        eager, lazy = pipeline(), Pipeline(FootprintConfig(), monotonic=lambda now=now: now[0])
        lazy.coalesce_s = 1.0
        for p in (eager, lazy):
            p.process(7, "probe")
        wm = 10**12
        live: dict[int, int] = {}
        waited = 0
        for step in range(300):
            now[0] += 0.05
            r = rng.random()
            if r < 0.6:
                rows = []
                for _ in range(int(rng.integers(1, 8))):
                    t = wm + int(rng.integers(1, 80)) * MS
                    if rng.random() < 0.03:
                        t = wm - int(rng.integers(0, 50)) * MS  # a late record (a probe's bug): counted either way
                    addr = int(rng.integers(1, 40)) << 21
                    if addr in live:
                        rows.append(mem(t, FREE, addr, live.pop(addr), pid=7, dev=addr % 3))
                    else:
                        live[addr] = size = int(rng.choice([4096, 2 << 20, 64 << 20]))
                        rows.append(mem(t, ALLOC, addr, size, pid=7, dev=addr % 3))
                for p in (eager, lazy):
                    p.submit(RecordKind.MEMORY, mem_batch(rows))
            elif r < 0.9:
                wm += int(rng.integers(0, 100)) * MS
                for p in (eager, lazy):
                    p.watermark(7, wm)
                waited += lazy.processes[7].due_to > lazy.processes[7].applied_to
            elif r < 0.95:
                # the probe's totals at its latest watermark: the lazy pipeline applies what waits first
                fp_totals = {dev: {DEV: (int(fp.live_by_kind[DEV]), sum(1 for e in fp.live.values() if e[1] == DEV))}
                             for dev, fp in eager.processes[7].devices.items()}
                for p in (eager, lazy):
                    p.verify(7, eager.processes[7].applied_to, fp_totals)
                assert _state(lazy) == _state(eager), (trial, step)
            else:
                lazy.apply_due()  # a tick: what waited a second is applied
            if lazy.processes[7].due_to <= lazy.processes[7].applied_to:
                assert _state(lazy) == _state(eager), (trial, step)
        lazy.apply_due(every=True)
        assert _state(lazy) == _state(eager), trial
        assert waited > 20  # watermarks did wait
