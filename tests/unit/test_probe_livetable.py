"""The probe's own live table: time order, profiler-gap rebuild, untracked entries."""

from __future__ import annotations

import random

import numpy as np
from gpufootprint.probe.livetable import LiveTable, untracked_address
from gpufootprint.records import DEVICE_RESIDENT_KINDS, MEMORY_DTYPE, MemoryKind


def rec(op: int, addr: int, size: int, ts: int, mk: int = 3, is_async: int = 0, dev: int = 0, corr: int = 1) -> tuple:
    return (ts, addr, size, 0, 0, 0, 0, 1, dev, 1, 7, corr, op, mk, is_async, 0)


def arr(rows: list[tuple]) -> np.ndarray:
    a = np.zeros(len(rows), MEMORY_DTYPE)
    for i, r in enumerate(rows):
        a[i] = r
    return a


def test_stream_ordered_address_reuse_delivered_shuffled_ends_exact() -> None:
    # GIVEN one address allocated and freed 200 times (cudaMallocAsync reuse), sizes varying
    rows = []
    for i in range(200):
        rows.append(rec(1, 0x1000, 100 + i, ts=10 * i, is_async=1))
        rows.append(rec(2, 0x1000, 100 + i, ts=10 * i + 5, is_async=1))
    rows.append(rec(1, 0x1000, 4242, ts=5000, is_async=1))
    random.Random(3).shuffle(rows)
    table = LiveTable()
    # WHEN they arrive in three shuffled buffers and the flush watermark passes them all
    for part in (rows[:150], rows[150:300], rows[300:]):
        table.add(arr(part))
    table.advance(10_000)
    # THEN exactly the last allocation is live, and no release went unmatched
    assert list(table.rows) == [0x1000] and table.rows[0x1000][2] == 4242
    assert table.stale_releases == 0


def test_records_newer_than_the_watermark_wait() -> None:
    table = LiveTable()
    table.add(arr([rec(1, 0xA, 10, ts=100), rec(1, 0xB, 20, ts=300)]))
    table.advance(200)
    assert set(table.rows) == {0xA}
    table.advance(300)
    assert set(table.rows) == {0xA, 0xB}
    assert table.live_by_kind(0) == {"device": 30}


def test_profiler_gap_rebuild_keeps_library_memory_and_replaces_pytorchs_segments() -> None:
    table = LiveTable()
    table.add(arr([rec(1, 0x1000, 4096, 1), rec(1, 0x9000_0000, 2 << 20, 2),  # torch segment, library block
                   rec(1, 0x5000, 64, 3, mk=int(MemoryKind.PINNED))]))
    table.advance(10)
    before = [(0, 0x1000, 4096)]
    after = [(0, 0x20_0000, 8 << 20)]  # during the gap torch freed the old segment and made a new one
    table.split_torch_owned(before + after)
    table.add_torch_segments(after, ts=20, pid=1)
    assert table.live_by_kind(0) == {"device": (2 << 20) + (8 << 20), "pinned": 64}
    assert table.device_bytes_outside(0, [[0, 0x20_0000, 8 << 20]]) == 2 << 20
    # an expandable segment unmaps one 2 MiB page in the middle: the range is cut, a resync is due
    table.add(arr([rec(2, 0x20_0000 + (2 << 20), 2 << 20, 30)]))
    table.advance(40)
    assert table.live_by_kind(0)["device"] == (2 << 20) + (6 << 20)
    assert table.range_splits == 1
    assert len(table.to_array(50)) == 4


def test_untracked_entry_is_replaced_not_added_and_applies_at_the_watermark_like_any_record() -> None:
    table = LiveTable()
    first = table.untracked_records(0, 1000, ts=1, pid=9)
    assert [r[12] for r in first] == [1]  # an allocation
    assert table.live_by_kind(0) == {}  # queued: the daemon applies it at the same watermark
    second = table.untracked_records(0, 1500, ts=2, pid=9)
    assert [(r[12], r[2]) for r in second] == [(2, 1000), (1, 1500)]  # release the old, allocate the new
    assert len(table.untracked_records(0, 1500, ts=3, pid=9)) == 0  # unchanged: nothing to send
    table.advance(2)
    assert table.live_by_kind(0) == {"untracked": 1500}
    assert table.resident_bytes(0) == 0 and table.resident_bytes(0, exclude_untracked=False) == 1500
    assert untracked_address(0) in table.rows
    assert table.stale_releases == 0


def test_resident_bytes_now_counts_what_is_queued() -> None:
    table = LiveTable()
    table.add(arr([rec(1, 0x1000, 4096, 10), rec(1, 0x2000, 8192, 11), rec(2, 0x1000, 4096, 12)]))
    assert table.resident_bytes(0) == 0 and table.resident_bytes_now(0) == 8192


def test_the_probes_table_follows_the_daemons_rule_for_a_release_stamped_after_the_reuse() -> None:
    """The probe's table resyncs the daemon: it must keep a reused address's new allocation when the
    old one's release is stamped after it (records.LATE_RELEASE_NS), by both of its paths."""
    for n in (3, 100):
        rows, truth_addrs = [], {}
        ts = 1_000_000
        for i in range(n):
            addr = 0x7000_0000 + i * 0x10_0000
            rows.append(rec(1, addr, 4096, ts, corr=10 * i + 1))
            rows.append(rec(1, addr, 1 << 20, ts + 1000, corr=10 * i + 3))
            rows.append(rec(2, addr, 4096, ts + 1000 + 300_000, corr=10 * i + 2))  # stamped 0.3 ms after the reuse
            truth_addrs[addr] = 1 << 20
            ts += 2_000_000
        random.Random(n).shuffle(rows)
        table = LiveTable()
        table.add(arr(rows))
        table.advance(ts + 1)
        assert {a: r[2] for a, r in table.rows.items()} == truth_addrs
        assert (table.late_release_repairs, table.lost_releases, table.stale_releases) == (n, 0, 0)


def test_the_probes_table_takes_a_quick_free_after_a_lost_release_as_the_new_allocations_own() -> None:
    rows = [rec(1, 0x10, 12288, 1_000, corr=100)]  # its release never came
    ts, corr = 1_000_000, 200
    for _ in range(100):
        rows += [rec(1, 0x10, 12288, ts, corr=corr), rec(2, 0x10, 12288, ts + 50_000, corr=corr + 1)]
        ts, corr = ts + 100_000, corr + 2
    rows.append(rec(1, 0x99, 512, ts + 200_000_000, corr=corr))  # later: the window has passed
    for bulk in (False, True):
        table = LiveTable()
        if bulk:
            table.add(arr(rows))
            table.advance(ts + 200_000_000)
        else:
            for r in rows:
                table.apply(arr([r]))
        assert list(table.rows) == [0x99] and table.late_release_repairs == 0 and table.lost_releases == 1


def _structs(rows: list[tuple]) -> np.ndarray:
    """MEMORY records as the MEMORY2 structs CUPTI writes (the fields the table reads)."""
    from gpufootprint.wire import cupti_layout

    recs = arr(rows)
    out = np.zeros(len(recs), cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2])
    for theirs, ours in (("timestamp", "ts"), ("address", "addr"), ("bytes", "bytes"), ("dev", "dev"),
                         ("ctx", "ctx"), ("stream", "stream"), ("corr", "corr"), ("op", "op"), ("mk", "mk"),
                         ("is_async", "is_async")):
        out[theirs] = recs[ours]
    return out


def _random_stream(seed: int) -> tuple[list[tuple], list[int]]:
    """Churn over a few addresses as CUPTI delivers it: out of time order, with now and then an
    address allocated again while live (its release lost or stamped late), a release of nothing,
    a large allocation that stays; and watermarks that leave the newest records waiting."""
    rng = random.Random(seed)
    rows: list[tuple] = []
    live: dict[int, int] = {}
    ts, corr = 1_000_000, 1
    for _ in range(rng.randrange(50, 1500)):
        ts += rng.randrange(1, 5_000)
        corr += 1
        addr = 0x7F00_0000_0000 + rng.randrange(rng.choice((4, 40, 400))) * 0x1_0000
        roll = rng.random()
        if addr in live and roll < 0.9:
            rows.append(rec(2, addr, live.pop(addr), ts, is_async=1, corr=corr))
        elif roll < 0.97 or addr in live:
            size = rng.randrange(1, 64) * 512
            rows.append(rec(1, addr, size, ts, is_async=1, corr=corr))
            live[addr] = size
        else:
            rows.append(rec(2, addr, 512, ts, is_async=1, corr=corr))  # a release of nothing
    window = rng.choice((1, 8, 64))  # how far delivery strays from time order
    keys = [i + rng.random() * window for i in range(len(rows))]
    delivered = [r for _, r in sorted(zip(keys, rows), key=lambda kr: kr[0])]
    marks = sorted(rng.sample(range(len(rows)), k=min(len(rows), rng.randrange(1, 12))))
    return delivered, [rows[i][0] - rng.randrange(0, 20_000) for i in marks] + [ts + 1]


def test_the_table_applies_cuptis_structs_exactly_as_it_applies_records() -> None:
    """Forwarded buffers reach the table as CUPTI's structs (``add_raw``), queued back to back and
    applied where they lie; packed batches as records (``add``). Both must leave the same table,
    counters and waiting records after every watermark, on churn delivered out of order."""
    for seed in range(60):
        delivered, watermarks = _random_stream(seed)
        rng = random.Random(-seed)
        by_records, by_structs = LiveTable(), LiveTable()
        at = 0
        for mark in watermarks:
            upto = min(len(delivered), at + rng.randrange(0, 2 * len(delivered) // len(watermarks) + 2))
            while at < upto:  # CUPTI's buffers: a few to a few hundred records each
                part = delivered[at:min(upto, at + rng.randrange(1, 300))]
                by_records.add(arr(part))
                by_structs.add_raw(_structs(part), pid=1)
                at += len(part)
            by_records.advance(mark)
            by_structs.advance(mark)
            assert by_structs.rows == by_records.rows, seed
            assert (by_structs.stale_releases, by_structs.late_release_repairs, by_structs.lost_releases) == \
                (by_records.stale_releases, by_records.late_release_repairs, by_records.lost_releases), seed
            assert by_structs.resident_bytes_now(0) == by_records.resident_bytes_now(0), seed
        assert by_structs.pending_array().tolist() == by_records.pending_array().tolist(), seed


def test_the_struct_queue_keeps_order_grows_and_gives_memory_back_after_a_burst() -> None:
    from gpufootprint.probe.livetable import StructQueue

    q = StructQueue(np.dtype([("ts", "<u8"), ("x", "<u4")]))
    burst = np.zeros(100_000, q.view().dtype)
    burst["ts"] = np.arange(len(burst))
    for i in range(0, len(burst), 777):  # appended in pieces, read back as one array
        q.append(burst[i:i + 777])
    assert q.view()["ts"].tolist() == list(range(len(burst)))
    q.keep(q.view()["ts"] % 3 == 0)  # what a watermark leaves waiting stays, in order
    assert q.view()["ts"].tolist() == list(range(0, len(burst), 3))
    held = q._buf.nbytes
    for _ in range(2 * StructQueue._SHRINK_EVERY):  # quiet watermarks after the burst (a whole period of them)
        q.append(burst[:10])
        q.clear()
    assert len(q) == 0 and q._buf.nbytes < held // 4


def test_the_struct_queue_against_a_list_through_appends_keeps_and_clears() -> None:
    """A watermark keeps the queue's tail (the last flush period's records) in place, without a copy; any
    other mask, an empty one, appends that need the space before the tail or a larger array, and the
    shrinking after a burst all leave the same records, in order, as a plain list does."""
    from gpufootprint.probe.livetable import StructQueue

    dt = np.dtype([("ts", "<u8"), ("x", "<u4")])
    rng = np.random.default_rng(11)
    q, model, next_ts = StructQueue(dt), [], 0
    for step in range(3000):
        op = rng.integers(0, 10)
        if op < 6:
            n = int(rng.choice([1, 7, 300, 2500]))
            part = np.zeros(n, dt)
            part["ts"] = np.arange(next_ts, next_ts + n)
            part["x"] = step
            next_ts += n
            q.append(part)
            model += list(zip(part["ts"].tolist(), part["x"].tolist(), strict=True))
        elif op < 8 and len(model):
            first = int(rng.integers(0, len(model) + 1))  # a watermark: the tail from ``first`` waits
            before, array = q.view(), q._buf
            mask = np.arange(len(model)) >= first
            q.keep(mask)
            model = model[first:]
            if model and q._buf is array:  # kept where it lay, or moved once to the front (no new memory)
                assert q.view().ctypes.data in (before.ctypes.data + first * dt.itemsize, array.ctypes.data)
        elif op < 9 and len(model):
            mask = rng.random(len(model)) < 0.5
            q.keep(mask)
            model = [m for m, k in zip(model, mask.tolist(), strict=True) if k]
        else:
            q.clear()
            model = []
        assert len(q) == len(model)
        assert list(zip(q.view()["ts"].tolist(), q.view()["x"].tolist(), strict=True)) == model, step


def test_the_struct_queue_shrinks_after_a_burst_with_its_tail_still_waiting() -> None:
    """After a burst the array gives memory back even when every watermark leaves a tail waiting (as under
    steady churn), and the tail it holds then is the same records, in order."""
    from gpufootprint.probe.livetable import StructQueue

    dt = np.dtype([("ts", "<u8"), ("x", "<u4")])
    q = StructQueue(dt)
    burst = np.zeros(200_000, dt)
    burst["ts"] = np.arange(len(burst))
    q.append(burst)
    q.keep(q.view()["ts"] >= 199_000)
    held, ts = q._buf.nbytes, 200_000
    for _ in range(2 * StructQueue._SHRINK_EVERY):
        part = np.zeros(100, dt)
        part["ts"] = np.arange(ts, ts + 100)
        ts += 100
        q.append(part)
        waiting = list(range(199_000 if ts == 200_100 else ts - 150, ts))  # held before this watermark
        assert q.view()["ts"].tolist() == waiting
        q.keep(q.view()["ts"] >= ts - 50)  # the newest 50 wait
        assert q.view()["ts"].tolist() == list(range(ts - 50, ts))
    assert q._buf.nbytes < held // 4


def test_records_of_other_operations_are_stepped_over_by_the_bulk_path_as_one_by_one() -> None:
    """MEMORY2 records whose operation is neither allocation nor release (0, 3) change nothing, on the bulk
    path (64 records or more at a watermark) as on the record-by-record one."""
    rng = random.Random(5)
    for seed in range(20):
        rows, ts = [], 1_000_000
        for i in range(300):
            ts += rng.randrange(1, 1000)
            addr = 0x7F00_0000_0000 + (i if seed % 2 else rng.randrange(40)) * 0x1_0000
            rows.append(rec(rng.choice((0, 1, 1, 2, 2, 3)), addr, 512 * rng.randrange(1, 9), ts, is_async=1, corr=i))
        bulk, each = LiveTable(), LiveTable()
        bulk.add_raw(_structs(rows), pid=1)
        bulk.advance(ts + 1)
        for i in range(0, len(rows), 10):  # below the bulk path's 64: record by record
            each.apply(arr(rows[i:i + 10]))
        assert bulk.rows.keys() == each.rows.keys(), seed
        assert (bulk.stale_releases, bulk.lost_releases) == (each.stale_releases, each.lost_releases), seed


def _walked_totals(table: LiveTable) -> dict[int, dict[int, list[int]]]:
    """The totals as a walk of every entry gives them (what ``totals`` answered before it kept sums)."""
    out: dict[int, dict[int, list[int]]] = {}
    for row in [*table.rows.values(), *table.ranges.values()]:
        pair = out.setdefault(row[8], {}).setdefault(row[13], [0, 0])
        pair[0] += row[2]
        pair[1] += 1
    return out


def test_the_totals_kept_as_rows_come_and_go_equal_a_walk_of_every_row_after_every_watermark() -> None:
    """The daemon checks itself against these totals at every watermark: the sums the table keeps must equal a
    walk of its entries on every path (records and structs, the bulk path and the record-by-record rule with
    lost and late releases, two devices and kinds, torch's segments after a profiler gap, untracked entries)."""
    for seed in range(60):
        delivered, watermarks = _random_stream(seed)
        rng = random.Random(seed + 1000)
        # two devices, two kinds, and allocations that are not stream-ordered (torch's segments hold those)
        delivered = [r[:8] + (rng.choice((0, 1)),) + r[9:13] + (rng.choice((3, 3, 2)), rng.choice((0, 1))) + r[15:]
                     for r in delivered]
        by_records, by_structs = LiveTable(), LiveTable()
        at = 0
        for i, mark in enumerate(watermarks):
            upto = min(len(delivered), at + rng.randrange(0, 2 * len(delivered) // len(watermarks) + 2))
            while at < upto:
                part = delivered[at:min(upto, at + rng.randrange(1, 300))]
                by_records.add(arr(part))
                by_structs.add_raw(_structs(part), pid=1)
                at += len(part)
            if i == 1 and seed % 3 == 0:  # a profiler gap: torch's segments replace what lies inside them
                segments = [(0, 0x7F00_0000_0000, 0x20_0000), (1, 0x7F00_0010_0000, 0x40_0000)]
                for table in (by_records, by_structs):
                    table.split_torch_owned(segments)
                    table.add_torch_segments(segments, mark, pid=1)
            if i == 2 and seed % 4 == 0:
                for table in (by_records, by_structs):
                    table.untracked_records(0, 1 << 20, mark, pid=1)
            by_records.advance(mark)
            by_structs.advance(mark)
            for table in (by_records, by_structs):
                assert table.totals() == _walked_totals(table), (seed, i)
                for dev in (0, 1):  # what the untracked poll reads, from the same sums
                    walked = sum(r[2] for r in [*table.rows.values(), *table.ranges.values()]
                                 if r[8] == dev and r[13] in DEVICE_RESIDENT_KINDS and r[13] != MemoryKind.UNTRACKED)
                    assert table.resident_bytes(dev) == walked, (seed, i, dev)
                    assert table.resident_bytes(dev, exclude_untracked=False) == walked + sum(
                        r[2] for r in table.rows.values() if r[8] == dev and r[13] == MemoryKind.UNTRACKED), (seed, i)


def test_many_allocations_that_stay_at_once_are_summed_as_a_walk_sums_them() -> None:
    """A model loading: thousands of allocations that stay, in one watermark, summed by (device, kind) with numpy;
    and a table made with rows already in it counts them."""
    rng = random.Random(9)
    rows = [rec(1, 0x7F00_0000_0000 + i * 0x10_0000, rng.randrange(1, 1 << 30), 1_000 + i, dev=rng.choice((0, 1, 7)),
                mk=rng.choice((2, 3)), is_async=1) for i in range(5000)]
    by_records, by_structs = LiveTable(), LiveTable()
    by_records.add(arr(rows))
    by_structs.add_raw(_structs(rows), pid=1)
    for table in (by_records, by_structs):
        table.advance(10_000)
        assert len(table.rows) == 5000 and table.totals() == _walked_totals(table)
    made = LiveTable(rows=dict(by_records.rows))
    assert made.totals() == _walked_totals(by_records)
