"""The footprint is exact, whatever the delivery order, and bad records are counted, not fatal."""

from __future__ import annotations

import random

import numpy as np
import pytest
from gpufootprint.config import FootprintConfig
from gpufootprint.footprint.peaks import FramePeaks
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import POOL_DTYPE, MemoryKind, PoolOp, RecordKind

from tests.conftest import ALLOC, FREE, mem, mem_batch

MS = 1_000_000


def _random_history(rng: random.Random, n: int, pid: int = 100) -> list[tuple]:
    """A valid allocation history in time order: addresses reused after release."""
    live: dict[int, tuple[int, int]] = {}
    rows = []
    ts = 1_000 * MS
    for _ in range(n):
        ts += rng.randint(1, 3 * MS)
        if live and rng.random() < 0.45:
            addr = rng.choice(sorted(live))
            size, kind = live.pop(addr)
            rows.append(mem(ts, FREE, addr, size, kind=kind, pid=pid))
        else:
            addr = 0x7000_0000 + rng.randrange(64) * 0x10_0000
            if addr in live:
                continue
            size = rng.choice([512, 4096, 2 << 20, 20 << 20])
            kind = rng.choice([MemoryKind.DEVICE, MemoryKind.DEVICE, MemoryKind.PINNED, MemoryKind.DEVICE_STATIC])
            live[addr] = (size, kind)
            rows.append(mem(ts, ALLOC, addr, size, kind=kind, pid=pid))
    return rows


def _brute_force(rows: list[tuple], t: int) -> dict[str, int]:
    """From scratch: replay records with ts <= t in time order, sum live bytes by kind."""
    live: dict[int, tuple[int, int]] = {}
    for ts, op, addr, size, kind, *_ in sorted(rows, key=lambda r: r[0]):
        if ts > t:
            break
        if op == ALLOC:
            live[addr] = (size, kind)
        else:
            live.pop(addr, None)
    out: dict[str, int] = {}
    for size, kind in live.values():
        name = MemoryKind(kind).name.lower()
        out[name] = out.get(name, 0) + size
    return out


def test_state_as_of_t_equals_brute_force_under_shuffled_delivery() -> None:
    rng = random.Random(7)
    rows = _random_history(rng, 3000)
    delivered = rows[:]
    # Delivery order differs from time order: shuffle within chunks of 40 records.
    for i in range(0, len(delivered), 40):
        chunk = delivered[i : i + 40]
        rng.shuffle(chunk)
        delivered[i : i + 40] = chunk
    probes = sorted(rng.sample([r[0] for r in rows], 25))
    pipeline = Pipeline(FootprintConfig(reorder_window_ms=10_000))
    cursor = 0
    for t in probes:
        # Deliver everything up to a little past t (as a flush would), in batches.
        while cursor < len(delivered) and max(r[0] for r in delivered[: cursor + 40]) <= t + 200 * MS:
            pipeline.submit(RecordKind.MEMORY, mem_batch(delivered[cursor : cursor + 40]))
            cursor += 40
        pipeline.advance(100, t)
        state = pipeline.device_state(100, 0)
        assert state is not None
        assert state.live_bytes == _brute_force(rows, t), f"as of {t}"
    assert pipeline.errors.counts == {}


def test_window_peak_catches_a_1ms_spike_between_scrapes() -> None:
    pipeline = Pipeline(FootprintConfig(window_peak_seconds=30, reorder_window_ms=0))
    base = 5_000 * MS
    rows = [mem(base, ALLOC, 0x10, 100 << 20), mem(base + 10 * MS, ALLOC, 0x20, 900 << 20),
            mem(base + 11 * MS, FREE, 0x20, 900 << 20), mem(base + 2_000 * MS, ALLOC, 0x30, 1 << 20)]
    pipeline.submit(RecordKind.MEMORY, mem_batch(rows))
    pipeline.advance(100, base + 3_000 * MS)
    state = pipeline.device_state(100, 0)
    assert state is not None
    assert state.device_bytes == (100 << 20) + (1 << 20)
    assert state.window_peak_bytes == (100 << 20) + (900 << 20)
    # 40 s later the spike has left the 30 s window; the level stays.
    pipeline.advance(100, base + 40_000 * MS)
    state = pipeline.device_state(100, 0)
    assert state is not None and state.window_peak_bytes == (101 << 20)


def test_frame_peaks_window_equals_brute_force() -> None:
    rng = random.Random(3)
    frame_ns, window_ns = 10 * MS, 250 * MS
    peaks = FramePeaks(frame_ns, window_ns)
    ts = np.cumsum(rng.choices(range(1, 4 * MS), k=2000)).astype(np.int64) + 10**12
    deltas = np.array(rng.choices([-3, -1, 1, 2, 5], k=2000), dtype=np.int64)
    levels = np.cumsum(deltas)
    for lo in range(0, 2000, 97):
        peaks.add(ts[lo : lo + 97], deltas[lo : lo + 97])
        now = int(ts[min(lo + 96, 1999)])
        # Brute force at frame resolution: the window opens at the start of its first frame.
        start = (now - window_ns) // frame_ns * frame_ns
        inside = (ts >= start) & (ts <= now)
        before = ts < start
        held = int(levels[before][-1]) if before.any() else 0
        expect = max([held, *levels[inside].tolist()])
        assert peaks.window_peak(now, window_ns) == expect


@pytest.mark.parametrize("seed", range(40))
def test_frame_peaks_window_equals_the_max_over_its_kept_frames_with_late_records_and_any_window(seed: int) -> None:
    # The window's peak is kept as the frames whose peak no later frame reaches; it must answer what a
    # walk over every kept frame answers, for windows that end now, in the past or in the future, after
    # late records rewrote older frames and after the oldest frames were pruned.
    rng = random.Random(seed)
    frame_ns = 10 * MS
    peaks = FramePeaks(frame_ns, rng.choice([50, 250, 1000]) * MS)
    t = 10**12
    level = 0
    for _ in range(rng.randint(1, 60)):
        n = rng.choice([1, 3, 40, 200])
        gaps = rng.choices([0, MS, 7 * MS, 30 * MS, 300 * MS], k=n)
        ts = t + np.cumsum(gaps).astype(np.int64)
        if rng.random() < 0.2 and t > 10**12 + 500 * MS:  # late: before the open frame
            ts = ts - rng.randint(20, 500) * MS
        deltas = np.array(rng.choices([-7, -1, 0, 1, 2, 9, 30], k=n), dtype=np.int64)
        peaks.add(np.sort(ts), deltas)
        t = max(t, int(ts.max()))
        level += int(deltas.sum())
        for _ in range(4):
            now = t + rng.choice([-400, -60, -10, 0, 0, 5, 200]) * MS
            window = rng.choice([1, 10, 35, 100, 250, 2000]) * MS
            first, last = (now - window) // frame_ns, now // frame_ns
            inside = [p for start, p in peaks.frames() if first <= start // frame_ns <= last]
            assert peaks.window_peak(now, window) == max([peaks.level, *inside])
    assert peaks.level == level


def test_a_late_record_that_raises_a_closed_frame_is_the_windows_peak_at_once() -> None:
    # A late record can land in a closed frame that is already kept (not a new one): the frames that no
    # later frame passes must be rebuilt, or the raised frame hides behind a newer, lower one.
    frame_ns = 10 * MS
    peaks = FramePeaks(frame_ns, 1000 * MS)
    t0 = 10**12
    ts = np.array([t0 + k * frame_ns for k in range(10)], dtype=np.int64)
    peaks.add(ts, np.array([100, -10, 5, -5, 1, -1, 1, -1, 1, -1], dtype=np.int64))  # 100 in frame 0, then lower
    now = int(ts[-1]) + 1
    assert peaks.window_peak(now, 500 * MS) == 100
    # Late: +1000 then -1000 inside frame 3, which closed long ago.
    peaks.add(np.array([t0 + 3 * frame_ns + 5, t0 + 3 * frame_ns + 6], dtype=np.int64),
              np.array([1000, -1000], dtype=np.int64))
    assert peaks.window_peak(now, 500 * MS) >= 1000
    assert peaks.window_peak(now, 500 * MS) == max(p for _, p in peaks.frames())
    assert peaks.late_frames == 1


def test_bad_records_are_counted_once_each_and_nothing_else_is_lost() -> None:
    pipeline = Pipeline(FootprintConfig(reorder_window_ms=0))
    rows = [mem(1 * MS, ALLOC, 0x10, 64), mem(2 * MS, FREE, 0x99, 64),  # release with no allocation
            mem(3 * MS, ALLOC, 0x10, 128),  # second allocation at a live address
            mem(4 * MS, ALLOC, 0x20, 32)]
    pipeline.submit(RecordKind.MEMORY, mem_batch(rows))
    pipeline.finish(100)
    state = pipeline.device_state(100, 0)
    assert state is not None and state.live_bytes == {"device": 128 + 32}
    assert pipeline.errors.counts == {"release_without_allocation": 1, "double_allocation": 1}


def test_pool_records_give_reserved_and_async_allocations_give_used() -> None:
    pipeline = Pipeline(FootprintConfig(reorder_window_ms=100))
    pools = np.zeros(3, dtype=POOL_DTYPE)
    pools["pid"], pools["addr"] = 100, 0xAA
    pools["ts"] = [1 * MS, 5 * MS, 6 * MS]
    pools["op"] = [PoolOp.CREATED, PoolOp.TRIMMED, PoolOp.TRIMMED]
    pools["size"] = [32 << 20, 64 << 20, 48 << 20]
    pipeline.submit(RecordKind.MEMORY_POOL, pools[::-1].copy())  # delivered backwards
    pipeline.submit(RecordKind.MEMORY, mem_batch([mem(2 * MS, ALLOC, 0x1, 1 << 20, is_async=1),
                                                  mem(3 * MS, ALLOC, 0x2, 2 << 20, is_async=1)]))
    pipeline.advance(100, 5 * MS)
    state = pipeline.device_state(100, 0)
    assert state is not None and state.pool_reserved_bytes == 64 << 20 and state.pool_used_bytes == 3 << 20
    pipeline.finish(100)
    state = pipeline.device_state(100, 0)
    assert state is not None and state.pool_reserved_bytes == 48 << 20


def test_late_record_beyond_the_reorder_window_is_applied_and_counted() -> None:
    pipeline = Pipeline(FootprintConfig(reorder_window_ms=1))
    pipeline.submit(RecordKind.MEMORY, mem_batch([mem(100 * MS, ALLOC, 0x1, 10)]))
    pipeline.submit(RecordKind.MEMORY, mem_batch([mem(50 * MS, ALLOC, 0x2, 5)]))
    pipeline.finish(100)
    state = pipeline.device_state(100, 0)
    assert state is not None and state.live_bytes == {"device": 15}
    assert pipeline.late_records == 1


def test_exited_process_holds_nothing_and_is_forgotten_after_the_grace_period() -> None:
    clock = [0.0]
    pipeline = Pipeline(FootprintConfig(process_grace_seconds=30), monotonic=lambda: clock[0])
    pipeline.submit(RecordKind.MEMORY, mem_batch([mem(1 * MS, ALLOC, 0x1, 10, pid=7)]))
    pipeline.process_exited(7)
    snap = pipeline.snapshot()
    assert snap.processes[0].exited and snap.processes[0].devices[0].live_bytes == {}
    clock[0] = 29.0
    assert pipeline.expire() == []
    clock[0] = 31.0
    assert pipeline.expire() == [7]
    assert pipeline.snapshot().processes == ()


def test_records_of_several_devices_and_processes_are_kept_apart() -> None:
    pipeline = Pipeline(FootprintConfig(reorder_window_ms=0))
    rows = [mem(1, ALLOC, 0x1, 10, pid=1, dev=0), mem(2, ALLOC, 0x2, 20, pid=1, dev=1),
            mem(3, ALLOC, 0x3, 40, pid=2, dev=1), mem(4, FREE, 0x1, 10, pid=1, dev=0)]
    pipeline.submit(RecordKind.MEMORY, mem_batch(rows))
    for pid in (1, 2):
        pipeline.finish(pid)
    assert pipeline.device_state(1, 0).live_bytes == {}  # type: ignore[union-attr]
    assert pipeline.device_state(1, 1).live_bytes == {"device": 20}  # type: ignore[union-attr]
    assert pipeline.device_state(2, 1).live_bytes == {"device": 40}  # type: ignore[union-attr]


def _walked_counts(fp) -> dict[int, int]:  # type: ignore[no-untyped-def]
    """Live allocations by kind as a walk of the table gives them (what ``live_counts`` was before it kept them)."""
    counts: dict[int, int] = {}
    for entry in fp.live.values():
        counts[entry[1]] = counts.get(entry[1], 0) + 1
    return counts


def _state(fp) -> tuple:  # type: ignore[no-untyped-def]
    assert fp.live_counts() == _walked_counts(fp)  # the counts kept as the table changes
    return ({a: tuple(e) for a, e in fp.live.items()}, list(fp.live_by_kind),
            fp.async_device_bytes, list(fp.allocations), list(fp.releases), list(fp.allocated_bytes),
            list(fp.released_bytes), fp.peaks.frames(), fp.peaks.level)


@pytest.mark.parametrize("each_order", [None, False, True])
def test_bulk_and_record_by_record_application_agree_even_on_broken_histories(each_order: bool | None) -> None:
    """``each_order`` None: the numpy path; else the C core's, in the numpy path's order (False) or the
    per-record path's (True)."""
    from gpufootprint.footprint.table import DeviceFootprint, IngestErrors

    rng = random.Random(11)
    for trial in range(60):
        rows = _random_history(rng, 400)
        if trial % 3 == 1:  # break it: drop some records, duplicate others
            rows = [r for r in rows if rng.random() > 0.05]
            rows += [rows[rng.randrange(len(rows))] for _ in range(5)]
            rows.sort(key=lambda r: r[0])
        if trial % 3 == 2:  # async allocations
            rows = [(*r[:7], 1) for r in rows]
        bulk = DeviceFootprint(pid=100, dev=0, peaks=FramePeaks(10 * MS, 1000 * MS), native=each_order is not None)
        each = DeviceFootprint(pid=100, dev=0, peaks=FramePeaks(10 * MS, 1000 * MS), native=False)
        assert (bulk._core is not None) == (each_order is not None)
        eb, ee = IngestErrors(), IngestErrors()
        for lo in range(0, len(rows), 64):
            batch = mem_batch(rows[lo : lo + 64])
            # the numpy path or the C core's, whatever the batch size
            got = (bulk._apply_memory_bulk(batch, eb) if each_order is None
                   else bulk._apply_memory_native(batch, eb, each_order))
            if got is None:
                bulk._apply_memory_each(batch, eb)
            each._apply_memory_each(batch, ee)
        assert _state(bulk) == _state(each), trial
        if each_order:  # the per-record path's dict order too
            assert list(bulk.live) == list(each.live), trial
        assert eb.counts == ee.counts, trial


def test_timestamps_beyond_int64_are_dropped_and_counted_not_fatal() -> None:
    from gpufootprint.hub import FeatureHub
    from gpufootprint.ingest.session import Session
    from gpufootprint.wire.framing import HEADER_SIZE, Frame, FrameType, encode_batch

    pipeline = Pipeline(FootprintConfig(reorder_window_ms=0), hub=FeatureHub())
    session = Session(pipeline, name="t")
    rows = [mem(5 * MS, ALLOC, 0x10, 64), mem((1 << 64) - 1, ALLOC, 0x20, 128), mem(6 * MS, ALLOC, 0x30, 32)]
    raw = encode_batch(RecordKind.MEMORY, mem_batch(rows))
    session.handle(Frame(FrameType.BATCH, RecordKind.MEMORY, raw[HEADER_SIZE:], 0))
    session.close()
    pipeline.process_exited(100)
    assert pipeline.errors.counts == {"bad_timestamp": 1}
    assert pipeline.snapshot().processes[0].exited


def _inverted_reuse(n: int, rng: random.Random, t0: int = 1_000 * MS) -> tuple[list[tuple], int]:
    """Two threads around the driver's lock: one frees an address, the other gets it back at once,
    and CUPTI stamps the free up to 0.5 ms after the new allocation. Returns the rows in time order
    and the bytes truly live at the end (every new allocation, plus a bystander)."""
    rows = [mem(t0, ALLOC, 0x9000_0000, 1 << 20, corr=1)]  # the bystander
    truth = 1 << 20
    ts = t0 + MS
    corr = 10
    for i in range(n):
        addr = 0x7000_0000 + i * 0x10_0000
        old = rng.choice([512, 4096, 2 << 20])
        new = rng.choice([512, 4096, 2 << 20])
        rows.append(mem(ts, ALLOC, addr, old, corr=corr))
        ts += MS
        rows.append(mem(ts, ALLOC, addr, new, corr=corr + 2))  # the reuse, stamped first
        # the old one's release: its call came before the reuse's (corr + 1), its record stamped late
        rows.append(mem(ts + rng.randint(1, 500_000), FREE, addr, old, corr=corr + 1))
        truth += new
        ts += MS
        corr += 3
    rows.sort(key=lambda r: r[0])
    return rows, truth


def test_a_release_stamped_after_the_reuse_of_its_address_retires_the_old_allocation() -> None:
    """Four PyTorch threads under caching off made 6 double_allocation errors on the H200, each
    under-counting a live allocation for its whole life. The rule: an allocation at a live address
    releases the old one (the driver reuses only free addresses); a release of that address within
    records.LATE_RELEASE_NS is the old one's late release. Both the numpy and the per-record paths."""
    for n in (3, 150):  # 3: the per-record path; 150 (451 records): the numpy path bails to it
        rows, truth = _inverted_reuse(n, random.Random(n))
        pipeline = Pipeline(FootprintConfig(reorder_window_ms=0))
        pipeline.submit(RecordKind.MEMORY, mem_batch(rows))
        pipeline.finish(100)
        state = pipeline.device_state(100, 0)
        assert state is not None and state.live_bytes == {"device": truth}
        assert pipeline.errors.counts == {}
        assert pipeline.errors.repairs == {"late_release_of_reused_address": n}
        # AND each new allocation's own release later is an ordinary release, exact to the end
        end = rows[-1][0] + 200 * MS
        frees = [mem(end + i, FREE, r[2], r[3], corr=10_000 + i) for i, r in enumerate(rows[2::3])]
        pipeline.submit(RecordKind.MEMORY, mem_batch(frees))
        pipeline.finish(100)
        state = pipeline.device_state(100, 0)
        assert state is not None and state.live_bytes == {"device": 1 << 20} and pipeline.errors.counts == {}


def test_a_reuse_whose_old_release_never_comes_is_still_one_error_and_the_new_one_is_kept() -> None:
    rows = [mem(1 * MS, ALLOC, 0x10, 4096, corr=1), mem(2 * MS, ALLOC, 0x10, 1 << 20, corr=5),  # 0x10's release lost
            mem(3 * MS, FREE, 0x10, 1 << 20, corr=6),  # the new one's own release: its call came after the reuse's
            mem(4 * MS, ALLOC, 0x20, 4096, corr=7), mem(5 * MS, ALLOC, 0x20, 512, corr=9),
            mem(400 * MS, FREE, 0x20, 512, corr=10)]  # past the window: an ordinary release of the new one
    pipeline = Pipeline(FootprintConfig(reorder_window_ms=0))
    pipeline.submit(RecordKind.MEMORY, mem_batch(rows))
    pipeline.finish(100)
    state = pipeline.device_state(100, 0)
    assert state is not None and state.live_bytes == {}
    assert pipeline.errors.counts == {"double_allocation": 2} and pipeline.errors.repairs == {}


def test_pool_config_per_pool_matches_the_record_by_record_rule() -> None:
    """note_pool_config works per pool with numpy; the rule is the one-record-at-a-time one."""
    from gpufootprint.footprint.table import DeviceFootprint
    from gpufootprint.records import MEMORY_DTYPE

    rng = np.random.default_rng(3)
    for trial in range(60):
        fp = DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10_000_000, 1_000_000_000))
        ref_pools: dict[int, tuple[int, int]] = {}
        ref_floor = 0
        for step in range(4):
            n = int(rng.integers(1, 40))
            recs = np.zeros(n, MEMORY_DTYPE)
            recs["pool_addr"] = rng.choice([0, 0x100, 0x200, 0x300], size=n)
            recs["pool_size"] = rng.choice([0, 1 << 20, 2 << 20], size=n) if trial % 2 else 1 << 20
            recs["pool_used"] = rng.integers(0, 1 << 20, size=n)
            fp.async_device_bytes = int(rng.integers(0, 1 << 30))
            for a, s, u in zip(recs["pool_addr"].tolist(), recs["pool_size"].tolist(), recs["pool_used"].tolist()):
                if a and s:
                    if ref_pools.get(a, (None,))[0] != s:
                        ref_floor = fp.async_device_bytes
                    ref_pools[a] = (s, u)
            fp.note_pool_config(recs)
            assert fp.pools == ref_pools and fp.pool_floor == ref_floor, (trial, step)


def test_a_lost_release_followed_by_quick_reuse_cycles_is_not_taken_for_late_releases() -> None:
    """Found by review in the H200 recording of four threads with caching off: one release CUPTI never
    wrote, then the address allocated and freed again and again within 100 ms. Each free is that
    allocation's own (its call came after the allocation's), so none may be absorbed as the lost one:
    the table ends exact with the lost release counted once, and no repair."""
    rows = [mem(1 * MS, ALLOC, 0x10, 12288, corr=100)]  # its release is never written
    corr, ts = 200, 1_000 * MS
    for _ in range(1000):
        rows += [mem(ts, ALLOC, 0x10, 12288, corr=corr), mem(ts + 50_000, FREE, 0x10, 12288, corr=corr + 1)]
        ts, corr = ts + 100_000, corr + 2
    for zero_corr in (False, True):  # CUPTI wrote no correlation id: no evidence of a late release either
        batch = mem_batch(rows)
        if zero_corr:
            batch["corr"] = 0
        pipeline = Pipeline(FootprintConfig(reorder_window_ms=0))
        pipeline.submit(RecordKind.MEMORY, batch)
        pipeline.finish(100)
        state = pipeline.device_state(100, 0)
        assert state is not None and state.live_bytes == {}
        assert pipeline.errors.counts == {"double_allocation": 1} and pipeline.errors.repairs == {}


def test_a_resync_and_an_exit_leave_the_kept_live_counts_as_a_walk_gives_them() -> None:
    """The probe's TOTALS are checked against ``live_counts``: kept as the table changes, they must follow a
    resync that replaces the table (with a duplicate address refused) and the exit that empties it."""
    from gpufootprint.footprint.table import DeviceFootprint, IngestErrors

    fp = DeviceFootprint(pid=100, dev=0, peaks=FramePeaks(10 * MS, 1000 * MS))
    errors = IngestErrors()
    fp._apply_memory_each(mem_batch([mem(1 * MS, ALLOC, 0x10, 64), mem(2 * MS, ALLOC, 0x20, 128)]), errors)
    table = mem_batch([mem(3 * MS, ALLOC, 0x30, 32), mem(3 * MS, ALLOC, 0x40, 32), mem(3 * MS, ALLOC, 0x40, 32),
                       mem(3 * MS, ALLOC, 0x50, 16, kind=2)])
    fp.replace_live(table, 3 * MS, errors)
    assert fp.live_counts() == _walked_counts(fp) == {3: 2, 2: 1}
    fp._apply_memory_each(mem_batch([mem(4 * MS, FREE, 0x30, 32)]), errors)
    assert fp.live_counts() == _walked_counts(fp) == {3: 1, 2: 1}
    fp.release_all(5 * MS)
    assert fp.live_counts() == {} == _walked_counts(fp)
