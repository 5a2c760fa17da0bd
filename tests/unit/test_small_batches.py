"""The pure-Python paths for small batches leave exactly what the numpy paths leave.

Each stage that takes a batch of records has a numpy path (a few dozen calls of fixed cost) and,
for batches below a size, a loop over the records. Here both are fed the same random batches,
one copy forced down the numpy path (its threshold set to 0), and their states compared after
every batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gpufootprint.config import SamplerConfig
from gpufootprint.features import frames as frames_mod
from gpufootprint.features import reuse as reuse_mod
from gpufootprint.features.frames import FrameBuilder
from gpufootprint.features.reuse import ReuseTracker
from gpufootprint.footprint import peaks as peaks_mod
from gpufootprint.footprint import table as table_mod
from gpufootprint.footprint.peaks import FramePeaks
from gpufootprint.footprint.table import DeviceFootprint
from gpufootprint.records import MEMCPY_DTYPE, MEMORY_DTYPE, MEMSET_DTYPE, CopyKind, MemoryKind, MemoryOp
from gpufootprint.sampler import burst as burst_mod
from gpufootprint.sampler import state as state_mod
from gpufootprint.sampler.state import ProcessSampler

from tests.random_batches import as_lists, burst_stretch, memory_batch, reuse_state

SEEDS = range(12)
MS = 1_000_000


@pytest.mark.parametrize("seed", SEEDS)
def test_reuse_of_small_batches_record_by_record_equals_the_batch_path(seed: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN two trackers (small capacity and history, so clears and compaction happen) fed the same
    # random batches of 1 to 60 records, one of them only ever down the numpy path
    rng = np.random.default_rng(seed)
    # (the Python paths: the C core, where built, is held to them in tests/unit/engines/test_reuse_native.py)
    small, bulk = ReuseTracker(capacity=300, history=256, native=False), ReuseTracker(capacity=300, history=256,
                                                                                      native=False)
    t = 10**15
    keys: set[int] = set()
    for _ in range(150):
        batch = memory_batch(rng, t, int(rng.integers(1, 61)), int(rng.choice([8, 64, 4096])),
                              sizeless=rng.random() < 0.1)
        t += 60_000_000
        keys.update(reuse_mod.reuse_keys(batch["addr"], batch["bytes"]).tolist())
        small.add(batch)
        monkeypatch.setattr(reuse_mod, "SMALL_BATCH", 0)
        bulk.add(batch)
        monkeypatch.setattr(reuse_mod, "SMALL_BATCH", 96)
        # THEN after every batch both hold the same counts, events, remembered sizes and freed keys
        probe = sorted(keys)[:400]
        assert reuse_state(small, probe) == reuse_state(bulk, probe)
    assert small.reused > 0 and small.allocations > small.reused


def _peaks_state(p: FramePeaks) -> tuple[Any, ...]:
    return list(p._frames), p._open_idx, p._open_peak, p.level, p.late_frames


@pytest.mark.parametrize("seed", SEEDS)
def test_frame_peaks_of_small_batches_walked_equal_the_batch_path(seed: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN two trackers fed the same level changes (runs in one frame, frames skipped, now and then
    # a batch reaching back into closed frames), one only ever down the numpy path
    rng = np.random.default_rng(seed)
    small, bulk = FramePeaks(10 * MS, 300 * MS), FramePeaks(10 * MS, 300 * MS)
    t = 10**15
    for _ in range(200):
        n = int(rng.integers(1, 140))
        start = t - int(rng.integers(0, 200)) * MS if rng.random() < 0.1 else t
        ts = (start + np.sort(rng.integers(0, int(rng.choice([1, 30, 500])) * MS, n))).astype(np.uint64)
        deltas = rng.choice([1 << 20, -(1 << 20), 64 << 20, -(64 << 20), 0, 512], n).astype(np.int64)
        t = max(t, int(ts[-1])) + int(rng.integers(0, 40)) * MS
        got = small.add(ts, deltas)
        monkeypatch.setattr(peaks_mod, "SMALL_BATCH", 0)
        want = bulk.add(ts, deltas)
        monkeypatch.setattr(peaks_mod, "SMALL_BATCH", 128)
        # THEN both keep the same frames and level, and hand on the same changes
        assert got.level_after == want.level_after and got.ts is ts and got.deltas is deltas
        assert _peaks_state(small) == _peaks_state(bulk)
    assert small.late_frames > 0


def _builder_state(b: FrameBuilder) -> tuple[Any, ...]:
    return (list(b._frames.items()), list(b._end_level.items()), b._newest_frame, b.reuse.allocations,
            b.reuse.reused, b.reuse.events().tolist())


@pytest.mark.parametrize("seed", SEEDS)
def test_frame_counters_of_small_batches_counted_record_by_record_equal_the_batch_path(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN two frame builders (short history, so pruning happens) fed the same memory batches and
    # level changes, one only ever down the numpy path
    rng = np.random.default_rng(seed)
    builders = [FrameBuilder(1, 0, FramePeaks(10 * MS, 300 * MS), keep_ns=200 * MS, migration_ns=50 * MS,
                             reuse_capacity=1000) for _ in range(2)]
    t = 10**15
    for _ in range(150):
        batch = memory_batch(rng, t, int(rng.integers(1, 140)), 64, sizeless=False)
        batch["bytes"] = np.minimum(batch["bytes"], np.uint64(1 << 42))  # validated sizes (ingest)
        t += int(rng.integers(1, 120)) * MS
        deltas = rng.choice([1 << 20, -(1 << 20), 0], len(batch)).astype(np.int64)
        level_after = int(rng.integers(0, 1 << 40))
        for builder, threshold in zip(builders, (128, 0)):
            monkeypatch.setattr(frames_mod, "SMALL_BATCH", threshold)
            monkeypatch.setattr(reuse_mod, "SMALL_BATCH", min(threshold, 96))
            builder.on_levels(batch["ts"], deltas, level_after)
            builder.on_memory(batch)
        # THEN both hold the same rows, end levels and reuse
        assert _builder_state(builders[0]) == _builder_state(builders[1])


@pytest.mark.parametrize("seed", SEEDS)
def test_pool_sizes_of_small_batches_noted_record_by_record_equal_the_batch_path(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN two footprints noting the same MEMORY2 pool fields (a few pools, sizes that change,
    # records without a pool), their async bytes moving between batches
    rng = np.random.default_rng(seed)
    fps = [DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS)) for _ in range(2)]
    for _ in range(200):
        n = int(rng.integers(1, 140))
        recs = np.zeros(n, MEMORY_DTYPE)
        recs["pool_addr"] = rng.choice(np.array([0, 0x1000, 0x2000, 0x3000], np.uint64), n)
        recs["pool_size"] = rng.choice(np.array([0, 1 << 20, 1 << 21, 1 << 22], np.uint64), n,
                                       p=[0.1, 0.6, 0.2, 0.1])
        recs["pool_used"] = rng.integers(0, 1 << 20, n).astype(np.uint64)
        if rng.random() < 0.5:  # one pool for the whole batch (cudaMallocAsync), its size now and then new
            recs["pool_addr"] = rng.choice(np.array([0x1000, 0x2000], np.uint64))
            recs["pool_size"] = rng.choice(np.array([1 << 20, 1 << 21], np.uint64))
            if rng.random() < 0.3:
                recs["pool_size"][int(rng.integers(0, n)):] = 1 << 22
        async_bytes = int(rng.integers(0, 1 << 30))
        for fp, threshold in zip(fps, (128, 0)):
            monkeypatch.setattr(table_mod, "_SMALL_POOL_BATCH", threshold)
            fp.async_device_bytes = async_bytes
            fp.note_pool_config(recs)
        # THEN both hold the same pools, in the same order, and the same floor
        assert list(fps[0].pools.items()) == list(fps[1].pools.items())
        assert fps[0].pool_floor == fps[1].pool_floor


@pytest.mark.parametrize("seed", SEEDS)
def test_burst_frames_judged_one_by_one_equal_the_numpy_judgement(seed: int) -> None:
    # GIVEN random stretches of burst frames (dense and sparse events, levels near and far from the
    # window's baseline, windows young and about to reach burst_max_ms) under random settings
    rng = np.random.default_rng(seed)
    for _ in range(300):
        cfg = SamplerConfig(burst_settle_ms=int(rng.choice([0, 10, 100])), burst_min_frames=int(rng.integers(1, 6)),
                            burst_max_ms=int(rng.choice([20, 300, 2000])), rate_min_events=int(rng.choice([1, 3, 50])),
                            enabled=bool(rng.random() < 0.95))
        # Events before the cursor were walked already; the rest lie ahead.
        stretch = burst_stretch(rng, max_frames=40, n_ahead=lambda: int(rng.integers(0, 60)), other_max=20)
        # THEN walking them frame by frame (from the lists of what lies ahead) judges as numpy does
        want = burst_mod.judge_frames(cfg, *stretch)
        got = burst_mod.walk_frames(cfg, *as_lists(stretch))
        assert got == want


def _copies(rng: np.random.Generator, t: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    cpy = np.zeros(n, MEMCPY_DTYPE)
    cpy["start"] = t + np.sort(rng.integers(0, 80 * MS, n))
    if rng.random() < 0.2:
        cpy["start"] = cpy["start"][rng.permutation(n)]
    cpy["end"] = cpy["start"] + rng.integers(-1000, 10**6, n)  # now and then ending before it starts
    cpy["bytes"] = rng.integers(0, 1 << 30, n).astype(np.uint64)
    cpy["ck"] = rng.choice([CopyKind.HTOD, CopyKind.DTOH, CopyKind.DTOD, CopyKind.PTOP, CopyKind.HTOH], n)
    cpy["src_dev"] = rng.integers(0, 3, n)
    cpy["dst_dev"] = rng.integers(0, 3, n)
    mset = np.zeros(n, MEMSET_DTYPE)
    mset["start"] = cpy["start"]
    mset["bytes"] = cpy["bytes"]
    return cpy, mset


def _copy_state(fp: DeviceFootprint, b: FrameBuilder) -> tuple[Any, ...]:
    # Items in order: the snapshot's dicts keep the Counters' order.
    return (list(fp.memcpy_count.items()), list(fp.memcpy_bytes.items()), list(fp.memcpy_ns.items()),
            list(fp.peer_copy_bytes.items()), fp.memset_count, fp.memset_bytes, list(b._frames.items()),
            [(f, list(c.items())) for f, c in b._copies.items()], list(b._windows.items()), b._newest_frame,
            b._newest_window)


@pytest.mark.parametrize("seed", SEEDS)
def test_copies_and_sets_of_small_batches_taken_record_by_record_equal_the_batch_path(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a footprint and a frame builder (short history: pruning) twice, fed the same copy and
    # set batches of every kind, one pair only ever down the numpy path
    rng = np.random.default_rng(seed)
    pairs = [(DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS)),
              FrameBuilder(1, 0, FramePeaks(10 * MS, 300 * MS), keep_ns=200 * MS, migration_ns=50 * MS,
                           reuse_capacity=1000)) for _ in range(2)]
    t = 10**15
    for _ in range(150):
        cpy, mset = _copies(rng, t, int(rng.integers(1, 140)))
        t += int(rng.integers(1, 120)) * MS
        for (fp, builder), threshold in zip(pairs, (128, 0)):
            monkeypatch.setattr(table_mod, "_SMALL_POOL_BATCH", threshold)
            monkeypatch.setattr(frames_mod, "SMALL_BATCH", threshold)
            fp.apply_memcpy(cpy)
            fp.apply_memset(mset)
            builder.on_memcpy(cpy)
            builder.on_memset(mset)
        # THEN both hold the same sums, rows, copies and windows, in the same order
        assert _copy_state(*pairs[0]) == _copy_state(*pairs[1])


class _EveryWalk(ProcessSampler):
    """The sampler as it was: every watermark walks what came, and the device check reads every record."""

    def __init__(self, pid: int, config: SamplerConfig) -> None:
        super().__init__(pid, config)
        self.wait_in_frame = False

    def add_levels(self, ts: np.ndarray, deltas: np.ndarray, dev: int) -> None:
        super().add_levels(ts, deltas, dev)
        self._mem_dev = state_mod._MIXED


def _sampler_state(s: ProcessSampler) -> tuple[Any, ...]:
    return (s.intervals(), s.closed_windows, s.last_peak, s.level_dev, s.level, s.mode, s.interval_ns,
            s.cursor, s.bursts, s.rate_ewma, s.range_ewma, s.window)


@pytest.mark.parametrize("seed", range(24))
def test_watermarks_inside_a_burst_frame_and_known_devices_leave_what_every_walk_leaves(seed: int) -> None:
    # GIVEN bursty traffic on one device or several, in small pieces with watermarks close together
    # (many inside one 5 ms burst frame), now and then level changes and events stamped before the
    # sampler's cursor (late), and events that move no level; fed to the sampler and to one that
    # walks at every watermark and compares every record's device
    rng = np.random.default_rng(seed)
    cfg = SamplerConfig(burst_settle_ms=int(rng.choice([0, 30, 100])), burst_min_frames=int(rng.integers(1, 6)),
                        burst_max_ms=int(rng.choice([40, 300, 2000])))
    fast, ref = ProcessSampler(1, cfg), _EveryWalk(1, cfg)
    t = 10**12
    devices = int(rng.choice([1, 1, 3]))
    for _ in range(300):
        late = rng.random() < 0.1
        n = int(rng.integers(0, 6 if rng.random() < 0.9 else 60))
        start = t - int(rng.integers(1, 30)) * MS if late else t
        ts = start + np.sort(rng.integers(0, int(rng.choice([1, 3, 40])) * MS, n))
        dev = int(rng.integers(0, devices))
        deltas = rng.choice([1 << 20, -(1 << 20), 64 << 20, -(64 << 20), 4 << 10], n)
        other = rng.random() < 0.3
        for s in (fast, ref):
            if n:
                s.add_levels(ts, deltas, dev)
            if other:
                s.add_events(np.sort(start + rng.integers(0, 3 * MS, 2)) if late else ts[:2])
        t = max(t, int(ts[-1]) if n else t) + int(rng.integers(0, 3 if rng.random() < 0.9 else 300)) * MS
        mark = t - int(rng.integers(0, 2)) * MS
        for s in (fast, ref):
            s.advance(mark)
        # THEN after every watermark both hold the same intervals, windows, peaks, levels and mode
        assert _sampler_state(fast) == _sampler_state(ref)
    for s in (fast, ref):
        s.finish(t + 5000 * MS)
    assert _sampler_state(fast) == _sampler_state(ref)
    assert fast.bursts > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_records_found_in_range_at_once_are_those_the_field_checks_keep_whole(seed: int) -> None:
    # GIVEN random batches of every record kind, most fields random, now and then a timestamp past
    # 2**63, a byte count past the limit (a unified-memory fault count's address among them), a device
    # number past the limit, an unknown API role or domain, a duration past the limit
    from gpufootprint.ingest.validate import MAX_DURATION_NS, Limits, check_fields, in_range
    from gpufootprint.records import DTYPES, MAX_TIMESTAMP_NS, TIME_FIELD, RecordKind

    rng = np.random.default_rng(seed)
    limits = Limits(max_record_bytes=1 << 40, max_devices_per_process=8)
    for _ in range(400):
        kind = RecordKind(int(rng.integers(1, len(RecordKind) + 1)))
        n = int(rng.choice([1, 3, 20, 64, 65, 300]))
        raw = rng.integers(0, 256, n * DTYPES[kind].itemsize, dtype=np.uint8)
        recs = raw.view(DTYPES[kind]).copy()
        names = DTYPES[kind].names or ()
        for name in names:  # mostly in range, so that whole batches pass too
            if name in ("bytes", "pool_size", "pool_used", "size", "used", "value"):
                recs[name] = rng.integers(0, 1 << 40, n) if rng.random() < 0.9 else rng.integers(0, 1 << 63, n)
            elif name in ("dev", "src_dev", "dst_dev"):
                recs[name] = rng.integers(0, 8, n) if rng.random() < 0.9 else rng.integers(0, 12, n)
            elif name in ("start", "ts"):
                recs[name] = rng.integers(0, 1 << 62, n)
            elif name == "role":
                recs[name] = rng.integers(1, 4, n) if rng.random() < 0.9 else rng.integers(0, 255, n)
            elif name == "domain":
                recs[name] = rng.choice([4, 5], n) if rng.random() < 0.9 else rng.integers(0, 255, n)
            elif name == "ck":
                recs[name] = rng.integers(0, 6, n)
        if "pid" in names and rng.random() < 0.3:
            recs["pid"] = 0  # device limits at their edge: the word of (pid, dev) is dev << 32 alone
        for name in ("bytes", "size", "dev"):
            if name in names and rng.random() < 0.2:  # values at the limits and one past them
                edge = limits.max_record_bytes if name != "dev" else limits.max_devices_per_process - 1
                recs[name][int(rng.integers(0, n))] = edge + int(rng.integers(0, 2))
        if "end" in names:
            recs["end"] = recs["start"] + rng.integers(0, MAX_DURATION_NS + (MAX_DURATION_NS // 10), n).astype(np.uint64)
            if rng.random() < 0.1:
                recs["end"] = recs["start"] - np.uint64(1)  # ends before it starts: a zero duration, kept
        if rng.random() < 0.05:
            recs[TIME_FIELD[kind]][int(rng.integers(0, n))] = MAX_TIMESTAMP_NS - 1 + int(rng.choice([0, 1, 1 << 40]))
        if rng.random() < 0.5:
            recs = recs[::-1].copy() if rng.random() < 0.5 else recs[::1]
        problems: list[str] = []

        def problem(reason: str, detail: str, k: int, problems: list[str] = problems) -> None:
            problems.append(reason)

        absurd = recs[TIME_FIELD[kind]] >= np.uint64(MAX_TIMESTAMP_NS)
        kept = check_fields(kind, recs[~absurd], limits, problem)
        whole = not absurd.any() and len(kept) == n and not problems
        # THEN a batch found in range is one the checks keep whole; for a few records, and for memory and
        # pool batches of any size, exactly those
        fast = in_range(kind, recs, limits)
        if fast:
            assert whole
        if n <= 64 or kind in (RecordKind.MEMORY, RecordKind.MEMORY_POOL):
            assert fast == whole, (kind, n)


def _stream(rng: np.random.Generator) -> list[Any]:
    """Random frames of one process: batches of every kind the footprint applies (over up to three
    devices, one batch now and then spread over several, out of time order, now and then a field out
    of range), watermarks, marks, heartbeats."""
    import json

    from gpufootprint.records import DTYPES, KERNEL_DTYPE, POOL_DTYPE, RecordKind
    from gpufootprint.wire.framing import Frame, FrameType

    frames: list[Any] = [Frame(FrameType.HELLO, 0, json.dumps({"pid": 7}).encode(), 0)]
    t = 10**15
    live: list[int] = []
    for _ in range(250):
        r = rng.random()
        n = int(rng.choice([1, 2, 5, 30, 64, 65, 200]))
        if r < 0.45:
            recs = np.zeros(n, MEMORY_DTYPE)
            for i in range(n):
                if live and rng.random() < 0.45:
                    recs[i]["op"], recs[i]["addr"] = MemoryOp.RELEASE.value, live.pop(int(rng.integers(0, len(live))))
                else:
                    addr = int(rng.integers(1, 1 << 20)) * 4096
                    recs[i]["op"], recs[i]["addr"] = MemoryOp.ALLOCATION.value, addr
                    live.append(addr)
            recs["bytes"] = rng.choice([512, 1 << 20, 64 << 20], n)
            recs["mk"] = MemoryKind.DEVICE.value
            recs["is_async"] = rng.random() < 0.5
            recs["pool_addr"], recs["pool_size"], recs["pool_used"] = 0x5000, 1 << 30, rng.integers(0, 1 << 30, n)
            kind = RecordKind.MEMORY
        elif r < 0.55:
            recs = np.zeros(n, POOL_DTYPE)
            recs["op"], recs["addr"], recs["size"] = 1, 0x5000 + 4096 * rng.integers(0, 3, n), 1 << 30
            kind = RecordKind.MEMORY_POOL
        else:
            kind = RecordKind(int(rng.choice([3, 4, 5])))
            recs = np.zeros(n, DTYPES[kind])
            recs["start"] = t + rng.integers(0, 40 * MS, n)
            recs["end"] = recs["start"] + rng.integers(0, MS, n).astype(np.uint64)
            recs["bytes" if kind is not RecordKind.KERNEL else "node"] = rng.integers(0, 1 << 30, n)
            if recs.dtype == KERNEL_DTYPE:
                recs["name_id"] = 1
        if kind in (RecordKind.MEMORY, RecordKind.MEMORY_POOL):
            recs["ts"] = t + np.sort(rng.integers(0, 40 * MS, n))
            if rng.random() < 0.2:
                recs["ts"] = recs["ts"][::-1]
        recs["pid"] = 7
        recs["dev"] = int(rng.integers(0, 3)) if rng.random() < 0.8 else rng.integers(0, 3, n)
        if rng.random() < 0.05:
            recs["dev"][int(rng.integers(0, n))] = 40  # out of range: dropped and counted
        if kind is RecordKind.MEMORY and rng.random() < 0.1:
            recs["ts"][int(rng.integers(0, n))] = 1 << 63  # past 2262
        frames.append(Frame(FrameType.BATCH, kind.value, recs.tobytes(), 0))
        t += int(rng.integers(0, 30)) * MS
        if rng.random() < 0.5:
            frames.append(Frame(FrameType.WATERMARK, 0, (t - int(rng.integers(0, 60)) * MS).to_bytes(8, "little"), 0))
        if rng.random() < 0.1:
            mark = {"pid": 7, "dev": int(rng.integers(0, 3)), "ts": t, "label": "m"}
            frames.append(Frame(FrameType.MARK, 0, json.dumps(mark).encode(), 0))
        if rng.random() < 0.05:
            frames.append(Frame(FrameType.HEARTBEAT, 0, json.dumps({"counters": {"sent": 1}}).encode(), 0))
    return frames


def _pipeline_state(p: Any) -> tuple[Any, ...]:
    procs = []
    for pid, proc in sorted(p.processes.items()):
        devs = []
        for dev, fp in sorted(proc.devices.items()):
            devs.append((dev, sorted((a, *e) for a, e in fp.live.items()),
                         list(fp.live_by_kind), fp.async_device_bytes, dict(fp.pools), fp.pool_floor,
                         fp.peaks.frames(), list(fp.memcpy_count.items()), list(fp.memcpy_bytes.items()),
                         list(fp.memcpy_ns.items()), fp.memset_count, fp.memset_bytes, fp.kernel_count, fp.kernel_ns))
        s = p.hub.samplers.get(pid)
        procs.append((pid, proc.applied_to, proc.pending_records, proc.max_ts, proc.late_records, devs,
                      s.intervals() if s else None, s.closed_windows if s else None))
    return (dict(p.records_ingested), dict(p.errors.counts), dict(p.errors.repairs), p.late_records,
            dict(p.late_by_kind), procs)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_stream_of_small_batches_leaves_what_the_numpy_checks_and_groupings_leave(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN the same random stream (small and larger batches of every kind, some out of order, some
    # spread over devices or with a field out of range; watermarks, marks) through two sessions, one
    # with the at-once range check off and every batch's times and devices taken with numpy
    from gpufootprint import pipeline as pipeline_mod
    from gpufootprint.config import FootprintConfig
    from gpufootprint.ingest import session as session_mod
    from gpufootprint.ingest.session import Session
    from gpufootprint.pipeline import Pipeline

    frames = _stream(np.random.default_rng(seed))
    marks: list[list[dict[str, Any]]] = [[], []]
    pipes = [Pipeline(FootprintConfig()), Pipeline(FootprintConfig())]
    sessions = [Session(p, on_mark=m.append) for p, m in zip(pipes, marks)]
    fast_in_range = session_mod.in_range
    for frame in frames:
        for i, (session, few, check) in enumerate(zip(sessions, (64, 0), (fast_in_range, None))):
            monkeypatch.setattr(pipeline_mod, "_FEW", few)
            monkeypatch.setattr(session_mod, "in_range", check or (lambda kind, recs, limits: False))
            session.handle(frame)
    for session in sessions:
        session.close()
    # THEN both pipelines hold the same footprints, errors, late counts, sampler intervals and marks
    assert _pipeline_state(pipes[0]) == _pipeline_state(pipes[1])
    assert marks[0] == marks[1] and sessions[0].problems == sessions[1].problems
    assert sum(pipes[0].errors.counts.values()) > 0  # some fields were out of range


@pytest.mark.parametrize("seed", range(4))
def test_records_taken_as_rows_of_words_equal_numpy_fancy_indexing(seed: int) -> None:
    # GIVEN record arrays of every kind (random bytes; contiguous, read-only, or a strided view),
    # random integer orders (empty, repeated positions, negative ones, argsorts) and random masks
    from gpufootprint.records import DTYPES, copy_records, select, take
    from gpufootprint.wire.cupti_layout import API_RAW_DTYPE, RAW_DTYPES

    rng = np.random.default_rng(seed)
    # ours, and CUPTI's structs as the probe queues them and picks its launch-window calls from
    for dtype in [*DTYPES.values(), *RAW_DTYPES.values(), API_RAW_DTYPE]:
        for _ in range(30):
            n = int(rng.choice([0, 1, 5, 300]))
            recs = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
            if rng.random() < 0.3:
                recs.flags.writeable = False
            if rng.random() < 0.2 and n:
                recs = recs[::2]
            m = len(recs)
            order = (np.argsort(rng.integers(0, 50, m), kind="stable") if rng.random() < 0.5
                     else rng.integers(-m, m, int(rng.integers(0, 2 * m + 1))) if m else np.zeros(0, np.int64))
            mask = rng.random(m) < rng.choice([0.0, 0.5, 1.0])
            # THEN the same records in the same order, dtype and shape, in a new writable array
            for got, want in ((take(recs, order), recs[order]), (select(recs, mask), recs[mask]),
                              (copy_records(recs), recs.copy())):
                assert got.dtype == want.dtype and got.shape == want.shape
                assert all(np.array_equal(got[f], want[f]) for f in dtype.names or ())
                if sum(f[0].itemsize for f in dtype.fields.values()) == dtype.itemsize:  # no gaps: every byte
                    assert got.tobytes() == want.tobytes()
                assert got.flags.writeable and not np.shares_memory(got, recs)


@pytest.mark.parametrize("seed", range(6))
def test_what_a_mark_reports_is_what_the_device_snapshot_says(seed: int) -> None:
    # GIVEN a pipeline fed a random stream (every kind, several devices), asked after every frame
    from gpufootprint.config import FootprintConfig
    from gpufootprint.ingest.session import Session
    from gpufootprint.pipeline import Pipeline

    p = Pipeline(FootprintConfig())
    session = Session(p)
    asked = 0
    for frame in _stream(np.random.default_rng(seed)):
        session.handle(frame)
        # THEN a mark's live bytes, pool reserved bytes and window peak are the device snapshot's
        for dev in range(4):
            state, figures = p.device_state(7, dev), p.mark_state(7, dev)
            if state is None:
                assert figures is None
                continue
            assert figures == (state.live_bytes, state.pool_reserved_bytes, state.window_peak_bytes)
            asked += 1
    assert asked > 100


@pytest.mark.parametrize("seed", SEEDS)
def test_a_small_batch_is_split_by_pid_as_the_numpy_path_splits_it(seed: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN two pipelines (a wide reorder window: records wait) fed the same random batches of 1 to 130
    # records of one pid, or of several (the first and last records' pids alike or not), one of them only
    # ever down the numpy path
    from gpufootprint import pipeline as pipeline_mod
    from gpufootprint.config import FootprintConfig
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.records import RecordKind

    rng = np.random.default_rng(seed)
    few, bulk = Pipeline(FootprintConfig(reorder_window_ms=10**6)), Pipeline(FootprintConfig(reorder_window_ms=10**6))
    t = 10**15
    for _ in range(100):
        batch = memory_batch(rng, t, int(rng.integers(1, 131)), 64, sizeless=False)
        pids = [int(p) for p in rng.choice([7, 8, 9], int(rng.integers(1, 4)), replace=False)]
        batch["pid"] = pids[0] if rng.random() < 0.6 else rng.choice(pids, len(batch))
        if rng.random() < 0.3:
            batch["pid"][[0, -1]] = pids[0]
        t += 60_000_000
        few.submit(RecordKind.MEMORY, batch)
        monkeypatch.setattr(pipeline_mod, "_FEW", 0)
        bulk.submit(RecordKind.MEMORY, batch)
        monkeypatch.undo()
        # THEN both hold the same processes (in the same order), each the same waiting records in order
        assert list(few.processes) == list(bulk.processes)
        for pid, proc in few.processes.items():
            other = bulk.processes[pid]
            assert (proc.pending_records, proc.pending_seq, proc.max_ts) == (
                other.pending_records, other.pending_seq, other.max_ts)
            mine, theirs = proc.pending[RecordKind.MEMORY], other.pending[RecordKind.MEMORY]
            assert [(a, s, r.tobytes(), h) for a, s, r, h in mine] == [(a, s, r.tobytes(), h) for a, s, r, h in theirs]


def test_per_kind_lists_named_by_kind_skip_the_zeros_as_a_comprehension_does() -> None:
    # GIVEN per-kind lists (indexed by memory kind number, 32 of them or more) mostly of zeros, now and then
    # a value at a named kind or an unnamed one, negative ones too
    from gpufootprint.footprint.device_snapshot import by_kind_name
    from gpufootprint.records import MEMORY_KIND_NAMES

    rng = np.random.default_rng(7)
    for _ in range(2000):
        n = int(rng.choice([32, 32, 40]))
        values = [int(v) for v in rng.choice([0, 0, 0, 1, -5, 1 << 40], n, p=[0.7, 0.1, 0.05, 0.05, 0.05, 0.05])]
        # THEN the kinds holding anything, named (or numbered) as the comprehension names them, in kind order
        want = {MEMORY_KIND_NAMES.get(k, str(k)): v for k, v in enumerate(values) if v}
        got = by_kind_name(values)
        assert list(got.items()) == list(want.items())


@pytest.mark.parametrize("kind_name", ["MEMORY", "MEMORY_POOL"])
def test_large_batches_found_in_range_block_by_block_are_those_the_field_checks_keep_whole(kind_name: str) -> None:
    # GIVEN memory and pool batches around and past the records compared at once (TILE_RECORDS), in range
    # but for at most one field of one record: first, last, either side of a block's edge, anywhere
    from gpufootprint.ingest.validate import TILE_RECORDS, Limits, check_fields, in_range
    from gpufootprint.records import DTYPES, TIME_FIELD, RecordKind

    kind = RecordKind[kind_name]
    limits = Limits(max_record_bytes=1 << 40, max_devices_per_process=8)
    rng = np.random.default_rng(29)
    fields = [TIME_FIELD[kind], "dev", *(("bytes", "pool_size") if kind is RecordKind.MEMORY else ("size", "used"))]
    too_big = {TIME_FIELD[kind]: 1 << 63, "dev": 8, "bytes": (1 << 40) + 1, "pool_size": 1 << 41,
               "size": (1 << 40) + 1, "used": 1 << 50}
    for n in (TILE_RECORDS - 1, TILE_RECORDS, TILE_RECORDS + 1, 2 * TILE_RECORDS + 7):
        recs = np.zeros(n, DTYPES[kind])
        recs[TIME_FIELD[kind]] = rng.integers(0, 1 << 62, n)
        recs["dev"] = rng.integers(0, 8, n)
        recs["pid"] = 4242
        assert in_range(kind, recs, limits)  # whole batches pass, every block of them
        for at in sorted({0, n - 1, min(TILE_RECORDS - 1, n - 1), min(TILE_RECORDS, n - 1), int(rng.integers(0, n))}):
            for name in fields:
                bad = recs.copy()
                bad[name][at] = too_big[name]
                kept = check_fields(kind, bad[bad[TIME_FIELD[kind]] < np.uint64(1 << 63)], limits,
                                    lambda *a: None)
                assert len(kept) < n  # the field checks drop it
                # THEN it is not found in range, whichever block it is in
                assert not in_range(kind, bad, limits), (n, at, name)
