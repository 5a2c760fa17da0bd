"""The probe table's pairing of a watermark's MEMORY2 structs in C (``gfp_pair``, ``nativecallbacks.Pairer``).

Under cudaMallocAsync a process writes about 57,000 memory records a second, and the probe's own table applied them
at each watermark with numpy's sort by address and time, holding the GIL for milliseconds. The C pass must leave the
table exactly as numpy's path does: the same rows in the same order, sums, counters, and the same records waiting.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest
from gpufootprint.probe import nativecallbacks
from gpufootprint.probe.livetable import LiveTable
from gpufootprint.wire import cupti_layout

from tests.unit.test_probe_livetable import _random_stream, _structs, rec

pytestmark = pytest.mark.skipif(not nativecallbacks.available(), reason="the probe's C library was not built")

RAW = cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2]


def _state(t: LiveTable) -> tuple[Any, ...]:
    return (list(t.rows.items()), t.totals(), t.stale_releases, t.lost_releases, t.late_release_repairs,
            sorted(t.reused.addresses()), t.pending_raw.view().tobytes(), list(t.ranges.items()))


def _threads_stream(seed: int) -> tuple[list[tuple], list[int]]:
    """Several allocating threads, each with addresses of its own and its records in time order, their CUPTI
    buffers delivered one thread's after another's (what a watermark's queue holds then: every address's
    records in time order, the queue as a whole not); many addresses, past the C pass's first hash table."""
    rng = random.Random(seed)
    threads = rng.choice((1, 2, 4))
    per_thread: list[list[tuple]] = [[] for _ in range(threads)]
    ts = 1_000_000
    spread = rng.choice((50, 3_000, 6_000))  # distinct addresses a thread uses
    live: list[dict[int, int]] = [{} for _ in range(threads)]
    for i in range(rng.randrange(2_000, 9_000)):
        ts += rng.randrange(1, 50)
        j = rng.randrange(threads)
        addr = 0x7F00_0000_0000 + (j << 36) + rng.randrange(spread) * 0x200
        if addr in live[j]:
            per_thread[j].append(rec(2, addr, live[j].pop(addr), ts, corr=i))
        else:
            size = 512 * rng.randrange(1, 9)
            per_thread[j].append(rec(rng.choice((1, 1, 1, 1, 1, 0)), addr, size, ts, corr=i))  # 0: not the table's
            live[j][addr] = size
    # each thread's buffers in turn, a buffer of up to 400 records at a time
    delivered: list[tuple] = []
    cursors = [0] * threads
    while any(c < len(p) for c, p in zip(cursors, per_thread)):
        j = rng.randrange(threads)
        take = rng.randrange(1, 400)
        delivered += per_thread[j][cursors[j]:cursors[j] + take]
        cursors[j] += take
    stamps = sorted(r[0] for r in delivered)
    marks = sorted(rng.sample(stamps, k=rng.randrange(1, 8))) + [ts + 1]
    return delivered, marks


def _pair_both(delivered: list[tuple], watermarks: list[int], rng: random.Random, paths: Counter[str],
               gap_at: int | None = None) -> None:
    c_side, numpy_side = LiveTable(pairer=nativecallbacks.Pairer()), LiveTable()
    for name in ("_apply_paired", "_apply_raw", "_apply_raw_each"):  # which paths the C side took
        inner = getattr(c_side, name)

        def counted(*args: Any, _inner: Any = inner, _name: str = name) -> Any:
            paths[_name] += 1
            return _inner(*args)

        setattr(c_side, name, counted)
    for name in ("keep", "drop_front"):  # what waits: interleaved (keep) or the queue's tail (drop_front)
        inner = getattr(c_side.pending_raw, name)

        def counted_queue(*args: Any, _inner: Any = inner, _name: str = name) -> Any:
            paths[_name] += 1
            return _inner(*args)

        setattr(c_side.pending_raw, name, counted_queue)
    at = 0
    for i, mark in enumerate(watermarks):
        upto = min(len(delivered), at + rng.randrange(0, 2 * len(delivered) // len(watermarks) + 2))
        while at < upto:
            part = delivered[at:min(upto, at + rng.randrange(1, 600))]
            for table in (c_side, numpy_side):
                table.add_raw(_structs(part), pid=1)
            at += len(part)
        if i == gap_at:  # a profiler gap: torch's segments, and the record-by-record rule from then on
            segments = [(0, 0x7F00_0000_0000, 0x20_0000)]
            for table in (c_side, numpy_side):
                table.split_torch_owned(segments)
                table.add_torch_segments(segments, mark, pid=1)
        for table in (c_side, numpy_side):
            table.advance(mark)
        assert _state(c_side) == _state(numpy_side), (i, mark)
    assert c_side.pairer is not None
    paths["unordered"] += c_side.pairer.unordered  # type: ignore[attr-defined]


def test_the_c_pairing_leaves_the_table_as_numpys_sort_does_after_every_watermark() -> None:
    """Churn delivered out of time order, releases of nothing, addresses allocated again while live (lost and
    late releases), other operations, several threads' buffers, thousands of addresses, a profiler gap: the
    same rows in the same order, totals, counters, reused addresses and waiting structs at every watermark."""
    paths: Counter[str] = Counter()
    for seed in range(80):
        delivered, watermarks = _random_stream(seed)
        _pair_both(delivered, watermarks, random.Random(-seed), paths, gap_at=1 if seed % 7 == 0 else None)
    for seed in range(40):
        delivered, watermarks = _threads_stream(seed)
        _pair_both(delivered, watermarks, random.Random(seed + 500), paths)
    # every path of the C side was taken, so none of the comparisons above held vacuously
    assert paths["_apply_paired"] > 50, paths
    assert paths["unordered"] > 5, paths  # an address's records out of time order, sorted in C
    assert paths["_apply_raw_each"] > 5, paths  # the record-by-record rule decided (twice, a live address, ranges)
    assert paths["keep"] > 20 and paths["drop_front"] > 20, paths  # structs waiting among those due, and after


def _raw(rows: list[tuple]) -> np.ndarray:
    return _structs(rows)


def test_the_pairer_answers_by_address_in_first_seen_order() -> None:
    a, b, c = 0x1000, 0x2000, 0x3000
    rows = [rec(1, a, 8, 10), rec(2, b, 8, 11), rec(1, c, 8, 12), rec(2, a, 8, 13), rec(1, b, 8, 14),
            rec(2, b, 8, 15), rec(2, b, 8, 16), rec(1, a, 8, 17), rec(1, 0x4000, 8, 99)]
    paired = nativecallbacks.Pairer()(_raw(rows), 20, 1, 2)
    assert paired is not None and not paired.twice
    assert paired.stay.tolist() == [7, 2]  # a's last allocation, c's
    assert paired.first_releases.tolist() == [b]
    assert paired.last_releases.tolist() == [b]
    assert paired.first_allocations.tolist() == [a, c]
    assert paired.repeated_releases == 1  # b released twice in a row
    # the struct stamped 99 waits: the queue's tail
    assert (paired.due, paired.first_waiting, paired.due_after_waiting) == (8, 8, 0)


def test_the_pairer_says_when_an_address_is_allocated_twice_in_time_order_and_still_counts_what_is_due() -> None:
    pair = nativecallbacks.Pairer()
    twice = pair(_raw([rec(1, 0x10, 8, 10), rec(1, 0x10, 8, 11), rec(2, 0x20, 8, 30), rec(2, 0x30, 8, 12)]), 20, 1, 2)
    assert twice is not None and twice.twice
    assert (twice.due, twice.first_waiting, twice.due_after_waiting) == (3, 2, 1)
    # twice in the queue, not in time: the release between them came in a later buffer (another thread's)
    fine = pair(_raw([rec(1, 0x10, 8, 10), rec(1, 0x10, 8, 30), rec(2, 0x10, 8, 20)]), 40, 1, 2)
    assert fine is not None and not fine.twice and fine.stay.tolist() == [1] and fine.repeated_releases == 0
    assert pair.twice == 1 and pair.unordered == 1 and pair.calls == 2


def test_the_pairer_sorts_an_addresss_records_by_time_keeping_queue_order_for_equal_stamps() -> None:
    pair = nativecallbacks.Pairer()
    late = pair(_raw([rec(1, 0x10, 8, 12), rec(2, 0x10, 8, 11), rec(1, 0x20, 8, 13)]), 20, 1, 2)
    assert late is not None and not late.twice
    assert late.stay.tolist() == [0, 2] and late.first_releases.tolist() == [0x10]
    assert late.first_allocations.tolist() == [0x20] and late.last_releases.tolist() == []
    # stamps 10, 10, 20 after sorting: the two at 10 in queue order (allocation, then release), so the address
    # is first allocated and released twice in a row; the other way round it would be first released
    ties = pair(_raw([rec(2, 0x10, 8, 20), rec(1, 0x10, 8, 10), rec(2, 0x10, 8, 10)]), 40, 1, 2)
    assert ties is not None and ties.first_allocations.tolist() == [0x10] and ties.repeated_releases == 1
    assert ties.last_releases.tolist() == [0x10] and ties.stay.tolist() == []
    # records past the cut are not looked at, in order or not
    past = pair(_raw([rec(1, 0x10, 8, 12), rec(2, 0x10, 8, 31), rec(2, 0x10, 8, 30)]), 20, 1, 2)
    assert past is not None and past.stay.tolist() == [0] and past.due == 1
    assert pair.unordered == 2


def _reference(rows: list[tuple], cut: int) -> tuple[Any, ...]:
    """What gfp_pair answers, in Python: each address's due records in time order (ties in queue order)."""
    by_addr: dict[int, list[tuple[int, int, int]]] = {}
    for i, r in enumerate(rows):
        if r[0] <= cut and r[12] in (1, 2):
            by_addr.setdefault(r[1], []).append((r[0], i, r[12]))
    stay, first_rel, last_rel, first_alloc, repeated = [], [], [], [], 0
    for addr, recs in by_addr.items():
        recs.sort()
        ops = [op for _, _, op in recs]
        if any(a == b == 1 for a, b in itertools.pairwise(ops)):
            return ("twice",)
        repeated += sum(a == b == 2 for a, b in itertools.pairwise(ops))
        (first_alloc if ops[0] == 1 else first_rel).append(addr)
        if ops[-1] == 1:
            stay.append(recs[-1][1])
        else:
            last_rel.append(addr)
    return stay, first_rel, last_rel, first_alloc, repeated


def test_the_pairer_against_a_python_model_on_random_queues_of_every_size_with_one_scratch() -> None:
    """One pairer, queues from 64 to 30,000 structs in random order of size (its scratch grows and shrinks, and
    its hash table is reused without clearing from call to call): the answer of a Python model every time."""
    pair, rng = nativecallbacks.Pairer(), random.Random(11)
    for call in range(120):
        n = rng.choice((64, 300, 5_000, 30_000)) if call % 3 else rng.randrange(64, 200)
        spread = rng.choice((4, 100, n))
        rows, ts = [], 1_000
        for i in range(n):
            ts += rng.randrange(0, 3)  # equal stamps too
            rows.append(rec(rng.choice((1, 2, 2, 1, 0)), 0x7000_0000 + rng.randrange(spread) * 0x200 + call * 0x10_0000,
                            8, ts, corr=i))
        if rng.random() < 0.5:  # a few records out of time order, as another thread's buffer leaves them
            for _ in range(rng.randrange(1, 20)):
                a, b = rng.randrange(n), rng.randrange(n)
                rows[a], rows[b] = rows[b], rows[a]
        cut = rows[rng.randrange(n)][0]
        got = pair(_raw(rows), cut, 1, 2)
        want = _reference(rows, cut)
        assert got is not None, call
        if want == ("twice",):
            assert got.twice, call
            continue
        assert not got.twice, call
        assert (got.stay.tolist(), got.first_releases.tolist(), got.last_releases.tolist(),
                got.first_allocations.tolist(), got.repeated_releases) == want, call
        due = [r[0] <= cut for r in rows]
        first_waiting = due.index(False) if False in due else n
        assert (got.due, got.first_waiting, got.due_after_waiting) == (sum(due), first_waiting,
                                                                          sum(due[first_waiting:])), call
    assert pair.twice > 10 and pair.unordered > 10


def test_the_pairer_steps_over_other_operations_and_refuses_structs_not_back_to_back() -> None:
    pair = nativecallbacks.Pairer()
    paired = pair(_raw([rec(0, 0x10, 8, 10), rec(3, 0x10, 8, 11), rec(1, 0x10, 8, 12)]), 20, 1, 2)
    assert paired is not None and paired.stay.tolist() == [2] and paired.due == 3
    empty = pair(np.zeros(0, RAW), 20, 1, 2)
    assert empty is not None and (empty.due, empty.first_waiting, len(empty.stay)) == (0, 0, 0)
    with pytest.raises(ValueError, match="back to back"):
        pair(_raw([rec(1, 0x10, 8, 10)] * 4)[::2], 20, 1, 2)


def test_a_probe_sender_pairs_in_c_where_the_library_loads_and_says_so() -> None:
    """The sender's table gets the C pairing by default, numpy's with ``native_pair`` off."""
    from gpufootprint.probe.core import Probe
    from gpufootprint.probe.settings import ProbeSettings

    assert isinstance(Probe(ProbeSettings()).sender.table.pairer, nativecallbacks.Pairer)
    assert Probe(ProbeSettings(native_pair=False)).sender.table.pairer is None
    assert ProbeSettings.from_env({"GPUFOOTPRINT_PROBE_NATIVE_PAIR": "0"}).native_pair is False


def test_a_failed_allocation_of_the_pairers_arrays_leaves_no_address_of_a_freed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of 2026-12-07: the work grown, then the answer's array failing (MemoryError under a memory limit,
    caught by the sender), left the cached address of the freed work for the next call to write its hash table
    into (a segfault, or the workload's heap corrupted)."""
    pair = nativecallbacks.Pairer()
    small = _raw([rec(1, 0x10 + i, 8, 10 + i) for i in range(64)])
    assert pair(small, 1 << 40, 1, 2) is not None
    real_zeros = np.zeros

    def failing(shape: Any, dtype: Any = float) -> np.ndarray:
        if isinstance(shape, tuple):  # the answer's (4, n) array
            raise MemoryError("out of memory (test)")  # noqa: TRY004 - what numpy raises
        return real_zeros(shape, dtype)

    big = _raw([rec(1, 0x10_0000 + i * 0x200, 8, 10 + i) for i in range(40_000)])
    monkeypatch.setattr(nativecallbacks.np, "zeros", failing)
    with pytest.raises(MemoryError):
        pair(big, 1 << 40, 1, 2)
    monkeypatch.undo()
    assert pair._at is None or pair._at[0] == pair._work.ctypes.data, "an address of freed work kept"
    again = pair(small, 1 << 40, 1, 2)  # fits the answer's old array: the work's address must be today's
    assert again is not None and again.stay.tolist() == list(range(64))
    assert pair._at is not None and pair._at[:2] == (pair._work.ctypes.data, len(pair._work))


def test_the_pairers_arrays_shrink_back_after_a_burst() -> None:
    pair = nativecallbacks.Pairer()
    pair(_raw([rec(1, 0x10_0000 + i * 0x200, 8, 10 + i) for i in range(50_000)]), 1 << 40, 1, 2)
    burst_work, burst_out = len(pair._work), pair._out.shape[1]
    small = _raw([rec(1, 0x10 + i, 8, 10 + i) for i in range(100)])
    for _ in range(2 * nativecallbacks.Pairer._SHRINK_EVERY):
        assert pair(small, 1 << 40, 1, 2) is not None
    assert len(pair._work) * 8 < burst_work and pair._out.shape[1] * 8 < burst_out, (len(pair._work), pair._out.shape)


def test_a_cut_outside_the_c_pass_s_range_goes_to_numpy_and_a_float_one_is_taken() -> None:
    pair = nativecallbacks.Pairer()
    rows = _raw([rec(1, 0x10, 8, 10), rec(2, 0x10, 8, 20)])
    assert pair(rows, -1, 1, 2) is None  # before any time: numpy's path says nothing is due
    paired = pair(rows, 15.0, 1, 2)  # type: ignore[arg-type]
    assert paired is not None and paired.due == 1 and paired.stay.tolist() == [0]
    every = pair(rows, 1 << 70, 1, 2)
    assert every is not None and every.due == 2 and every.last_releases.tolist() == [0x10]


@pytest.mark.parametrize("recording", ["h100_native_probe_churn_async", "h200_probe_churn_async",
                                       "h200_survive_threads_async", "h100_native_probe_churn_nocache"])
def test_real_churn_recordings_pair_in_c_at_every_watermark_and_end_as_numpys_table(recording: str) -> None:
    """The H100 and H200 recordings of allocation churn (cudaMallocAsync, caching off, four threads), their
    memory records as forwarded structs: the C pass sends a watermark to Python's record-by-record loop only where
    numpy's path does too (the first version sent most of them there: an allocation twice in queue order, not in
    time), applies the rest as it answers, and the table ends as numpy's."""
    from pathlib import Path

    from tests.script_module import load_script

    root = Path(__file__).resolve().parents[2]
    replay = load_script(root / "bench" / "probe_table_replay.py", "bench_probe_table_replay")
    got = replay.replay(str(root / "tests" / "data" / f"{recording}.gfp.gz"))
    assert got["tables_equal"] and got["applied_in_c"] >= 3, got
    assert got["record_by_record_c"] == got["record_by_record_numpy"] <= 1, got


def test_the_heartbeat_counts_watermarks_applied_in_c_and_those_sent_to_the_record_by_record_rule() -> None:
    from gpufootprint.probe.core import Probe
    from gpufootprint.probe.settings import ProbeSettings

    sender = Probe(ProbeSettings()).sender
    churn = [rec(1 + i % 2, 0x10_0000 + (i // 2) * 0x200, 8, 10 + i) for i in range(200)]
    sender.table.add_raw(_raw(churn), pid=1)
    sender._advance_table(1_000)
    lost = [rec(1, 0x20_0000, 8, 2_000), rec(1, 0x20_0000, 8, 2_001)]  # a release CUPTI never wrote
    sender.table.add_raw(_raw(lost + [rec(1 + i % 2, 0x30_0000 + (i // 2) * 0x200, 8, 2_002 + i) for i in range(100)]),
                         pid=1)
    sender._advance_table(3_000)
    c = sender._counter_values()
    assert (c["native_pairs"], c["native_pairs_twice"], c["native_pairs_unordered"]) == (1, 1, 0), c
    assert c["native_read_retries"] == 0
