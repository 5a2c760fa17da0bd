"""The probe's own live table: time order, profiler-gap rebuild, untracked entries."""

from __future__ import annotations

import random

import numpy as np
from gpufootprint.probe.livetable import LiveTable, untracked_address
from gpufootprint.records import MEMORY_DTYPE, MemoryKind


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
