"""The fast paths for large batches leave exactly what the general numpy paths leave.

Each fast path takes a batch in fewer numpy calls (one bincount over cells instead of a selection
per key, ...) and falls back to the general path where its shortcut does not hold. Here both are fed
the same random batches, one copy with the fast path switched off, and their states compared after
every batch, dict orders included (the snapshot's dicts keep them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gpufootprint.config import SamplerConfig
from gpufootprint.features import frames as frames_mod
from gpufootprint.features import keyset as keyset_mod
from gpufootprint.features import reuse as reuse_mod
from gpufootprint.features.frames import FrameBuilder
from gpufootprint.features.keyset import KeySet
from gpufootprint.features.reuse import ReuseTracker
from gpufootprint.footprint import cells
from gpufootprint.footprint import table as table_mod
from gpufootprint.footprint.peaks import FramePeaks
from gpufootprint.footprint.table import DeviceFootprint
from gpufootprint.ingest.validate import _BYTES, _DEVICES, MAX_DURATION_NS, Limits, check_fields
from gpufootprint.records import (
    DTYPES,
    MEMCPY_DTYPE,
    MEMORY_DTYPE,
    UM_CPU_PAGE_FAULT_COUNT,
    CopyKind,
    MemoryKind,
    MemoryOp,
    RecordKind,
    sorted_positions,
)
from gpufootprint.sampler import burst as burst_mod
from gpufootprint.sampler import state as state_mod
from gpufootprint.sampler.state import ProcessSampler
from gpufootprint.wire.framing import PREAMBLE, FrameDecoder, FrameType, encode_batch, encode_json

from tests.random_batches import as_lists, burst_stretch, memory_batch, reuse_state

SEEDS = range(12)
MS = 1_000_000


def _copies(rng: np.random.Generator, t: int, n: int) -> np.ndarray:
    """Copies over a short or a long stretch of time (many frames per record: the general path),
    sometimes out of time order, with sizes now and then past float64's exact integers."""
    cpy = np.zeros(n, MEMCPY_DTYPE)
    spread = int(rng.choice([3 * MS, 80 * MS, 5_000 * MS], p=[0.45, 0.35, 0.2]))
    cpy["start"] = t + np.sort(rng.integers(0, spread, n))
    if rng.random() < 0.1:
        cpy["start"] = cpy["start"][rng.permutation(n)]
    cpy["end"] = cpy["start"] + rng.integers(-1000, 10**6, n)  # now and then ending before it starts
    top = int(rng.choice([1 << 30, 1 << 50, 1 << 62], p=[0.7, 0.15, 0.15]))
    cpy["bytes"] = rng.integers(0, top, n).astype(np.uint64)
    cpy["ck"] = rng.choice([CopyKind.HTOD, CopyKind.DTOH, CopyKind.DTOD, CopyKind.PTOP, CopyKind.HTOH], n)
    cpy["src_dev"] = rng.integers(0, 3, n)
    cpy["dst_dev"] = rng.integers(0, 3, n)
    return cpy


def _copy_state(fp: DeviceFootprint, b: FrameBuilder) -> tuple[Any, ...]:
    return (list(fp.memcpy_count.items()), list(fp.memcpy_bytes.items()), list(fp.memcpy_ns.items()),
            list(fp.peer_copy_bytes.items()), list(b._frames.items()),
            [(f, list(c.items())) for f, c in b._copies.items()], list(b._windows.items()), b._newest_frame,
            b._newest_window)


@pytest.mark.parametrize("seed", SEEDS)
def test_copies_summed_per_cell_equal_the_per_kind_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a footprint and a frame builder (short history: pruning) twice, fed the same large copy
    # batches, one pair with the per-cell sums switched off
    # (migration windows of whole frames, whose sums are their frames', or not)
    rng = np.random.default_rng(seed)
    migration_ns = 50 * MS if seed % 2 else 35 * MS
    pairs = [(DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS)),
              FrameBuilder(1, 0, FramePeaks(10 * MS, 300 * MS), keep_ns=2_000 * MS, migration_ns=migration_ns,
                           reuse_capacity=1000)) for _ in range(2)]
    t = 10**15
    fast = 0
    for _ in range(60):
        cpy = _copies(rng, t, int(rng.integers(129, 3000)))
        t += int(rng.integers(1, 6_000)) * MS
        for (fp, builder), on in zip(pairs, (True, False)):
            if not on:
                monkeypatch.setattr(frames_mod, "cell_sums", lambda *a: None)
                monkeypatch.setattr(table_mod, "key_sums", lambda *a: None)
            fp.apply_memcpy(cpy)
            builder.on_memcpy(cpy)
            monkeypatch.undo()
        fast += cells.cell_sums(cpy["ck"], cpy["start"].astype(np.int64) // (10 * MS),
                                [cpy["bytes"].astype(np.int64)], 4 * len(cpy) + 64) is not None
        # THEN both hold the same sums, rows, copies and windows, in the same order
        assert _copy_state(*pairs[0]) == _copy_state(*pairs[1])
    assert 10 < fast < 60  # both paths were taken


def test_cell_sums_answer_none_where_float64_would_round() -> None:
    # GIVEN two records whose sum passes 2**53
    keys = np.array([1, 1], np.uint8)
    frames = np.array([5, 5], np.int64)
    big = np.array([1 << 52, (1 << 52) + 1], np.int64)
    # THEN no sums are given for them, and the same records with small sizes are summed exactly
    assert cells.cell_sums(keys, frames, [big], 100) is None
    assert cells.key_sums(keys, [big]) is None
    assert cells.cell_sums(keys, frames, [big >> 30], 100) == ([1], [5], [2], [[1 << 23]])
    # AND a batch out of frame order, or over more cells than allowed, is left to the general path
    assert cells.cell_sums(keys, np.array([6, 5], np.int64), [big >> 30], 100) is None
    assert cells.cell_sums(keys, np.array([0, 1000], np.int64), [big >> 30], 100) is None


@pytest.mark.parametrize("seed", SEEDS)
def test_key_set_first_round_and_python_tail_equal_the_probe_rounds(seed: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN two key sets fed the same batches of keys (repeats, the key 0 now and then, batches
    # small and large), one with the whole-batch first round and the Python tail switched off
    rng = np.random.default_rng(seed)
    sets = [KeySet(), KeySet()]
    pool = rng.integers(0, 1 << 63, 5000, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    pool[:3] = 0
    never = rng.integers(0, 1 << 63, 2000, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)  # odd
    for _ in range(80):
        keys = rng.choice(pool, int(rng.integers(1, 3000)))
        asked = rng.choice(np.concatenate([pool, never]), int(rng.integers(1, 3000)))
        got = []
        for ks, on in zip(sets, (True, False)):
            if not on:
                monkeypatch.setattr(keyset_mod, "_ROUND_ONE_MIN", 1 << 62)
                monkeypatch.setattr(keyset_mod, "_PYTHON_TAIL", 0)
            got.append((ks.add(keys).tolist(), ks.find(asked).tolist(), ks.contains(asked).tolist()))
            monkeypatch.undo()
        # THEN both give the same slots and answers and hold the same table, slot for slot
        assert got[0] == got[1]
        assert sets[0]._table.tobytes() == sets[1]._table.tobytes() and sets[0].size == sets[1].size
        if rng.random() < 0.05:
            for ks in sets:
                ks.clear()
    assert any(got[0][2]) and not all(got[0][2])


def _reuse_against(seed: int, monkeypatch: pytest.MonkeyPatch, knob: str, batches: int,
                   addrs: list[int]) -> None:
    """Two trackers (small capacity and history: clears and compaction happen) fed the same large random
    batches, the second with ``knob`` of features/reuse.py set past any batch (the reference path); after
    every batch both hold the same counts, events, remembered sizes and freed keys."""
    rng = np.random.default_rng(seed)
    fast = ReuseTracker(capacity=3000, history=2048, native=False)  # the Python paths (the C core: test_reuse_native.py)
    reference = ReuseTracker(capacity=3000, history=2048, native=False)
    t = 10**15
    keys: set[int] = set()
    for _ in range(batches):
        batch = memory_batch(rng, t, int(rng.integers(97, 2500)), int(rng.choice(addrs)), sizeless=rng.random() < 0.1)
        t += 60_000_000
        keys.update(reuse_mod.reuse_keys(batch["addr"], batch["bytes"]).tolist())
        fast.add(batch)
        monkeypatch.setattr(reuse_mod, knob, 1 << 62)
        reference.add(batch)
        monkeypatch.undo()
        probe = sorted(keys)[:600]
        assert reuse_state(fast, probe) == reuse_state(reference, probe)
    assert fast.reused > 0 and fast.allocations > fast.reused


@pytest.mark.parametrize("seed", SEEDS)
def test_reuse_looked_up_together_equals_lookup_then_add(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN large random batches, looked up together and apart (the lookup, then the add of every release)
    # THEN after every batch both trackers hold the same state
    _reuse_against(seed, monkeypatch, "_PROBE_TOGETHER_MIN", 60, [64, 512, 8192])


@pytest.mark.parametrize("seed", SEEDS)
def test_reuse_of_large_batches_equals_the_record_by_record_walk(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN large random batches (keys repeat within a batch: an address allocated, released and allocated
    # again), through the batch path and walked record by record (``_add_small``, the reference for the batch
    # path's matching of allocations that missed the set against the first release of their key in the batch)
    # THEN after every batch both trackers hold the same state
    _reuse_against(seed, monkeypatch, "SMALL_BATCH", 40, [8, 64, 512, 8192])


@pytest.mark.parametrize("seed", SEEDS)
def test_sorted_positions_equal_the_stable_argsort(seed: int) -> None:
    # GIVEN random unsigned 64-bit values of every size up to a few thousand, with many repeats (addresses
    # allocated and released in one batch), spans small, right at and past the room left for positions,
    # from zero or from a random smallest value, in no order or in a few sorted runs
    rng = np.random.default_rng(seed)
    for _ in range(80):
        n = int(rng.choice([0, 1, 2, 3, 7, 192, 1347, 4096, 4097, 14100]))
        bits = max(1, (n - 1).bit_length())
        top = int(rng.choice([1 << 20, 1 << 48, 1 << (64 - bits), (1 << (64 - bits)) + 1, 1 << 64]))
        lo = 0 if top == 1 << 64 or rng.random() < 0.4 else int(rng.integers(0, (1 << 64) - top, dtype=np.uint64))
        pool = rng.integers(0, top, max(1, n // int(rng.choice([1, 3, 50]))), dtype=np.uint64, endpoint=False)
        values = rng.choice(pool, n) + np.uint64(lo) if n else np.zeros(0, np.uint64)
        if n > 1 and rng.random() < 0.3:
            values[int(rng.integers(n))] = np.uint64(lo)
            values[int(rng.integers(n))] = np.uint64(lo + top - 1)  # the widest span the range allows
        if n > 1 and rng.random() < 0.4:  # in a few sorted runs (addresses allocated in order), around _FEW_RUNS
            runs = np.array_split(values, int(rng.choice([1, 2, 7, 8, 9, 30])))
            values = np.concatenate([np.sort(r) for r in runs])
        recs = np.zeros(n, MEMORY_DTYPE)
        recs["addr"] = values
        # WHEN sorted by sorted_positions (here of a column of records, as the footprint asks)
        order, ordered = sorted_positions(recs["addr"])
        # THEN the positions are the stable sort's, and the values are the values in that order
        expected = np.argsort(values, kind="stable")
        assert order.dtype == expected.dtype and np.array_equal(order, expected)
        assert ordered.dtype == np.uint64 and np.array_equal(ordered, values[expected])


@pytest.mark.parametrize("seed", SEEDS)
def test_live_table_searched_in_the_batch_equals_the_lookup_of_each_address(seed: int) -> None:
    # GIVEN live tables of 0 to a few hundred addresses and batches' allocation addresses (distinct,
    # ascending) of up to a few thousand, overlapping the table now and then: at the first or last address
    # of the batch, past its end, before its start, anywhere
    rng = np.random.default_rng(seed)
    for _ in range(300):
        space = int(rng.choice([64, 4096, 1 << 40, 1 << 64]))
        n_live, n_batch = int(rng.choice([0, 1, 2, 31, 32, 300])), int(rng.choice([0, 1, 8, 250, 257, 900, 3000]))
        batch = np.unique(rng.integers(0, space, n_batch, dtype=np.uint64, endpoint=False))
        live_addrs = set(rng.integers(0, space, n_live, dtype=np.uint64, endpoint=False).tolist())
        if len(batch) and rng.random() < 0.5:
            live_addrs.add(int(batch[int(rng.choice([0, len(batch) - 1, int(rng.integers(len(batch)))]))]))
        live = {a: (1, 3, 0, False) for a in live_addrs}
        # WHEN the bulk path asks whether the batch allocates at a live address
        got = table_mod._allocates_live(live, batch)
        # THEN it answers what the lookup of every address in the table answers
        assert got == (not live.keys().isdisjoint(batch.tolist()))


@pytest.mark.parametrize("seed", SEEDS)
def test_sampler_levels_taken_in_order_equal_the_stable_sort(seed: int) -> None:
    # GIVEN level changes of two devices in chunks, most of them following each other in time, some not
    rng = np.random.default_rng(seed)
    for _ in range(40):
        sampler = ProcessSampler(1, SamplerConfig())
        t = int(rng.integers(0, 10**12))
        chunks = []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(0, 300))
            ts = t + np.sort(rng.integers(0, 10**6, n))
            if rng.random() < 0.3:
                ts = ts - int(rng.integers(0, 10**6))  # overlaps the chunk before it
            t = int(ts[-1]) if n else t
            chunks.append((ts.astype(np.int64), rng.integers(-100, 100, n).astype(np.int64), int(rng.integers(0, 2))))
        for ts, deltas, dev in chunks:
            sampler.add_levels(ts, deltas, dev)
        got = sampler._take_mem()
        # THEN the taken arrays are those of a stable sort by time of the joined chunks
        ts = np.concatenate([c[0] for c in chunks])
        order = np.argsort(ts, kind="stable")
        want = (ts[order], np.concatenate([c[1] for c in chunks])[order],
                np.concatenate([np.full(len(c[0]), c[2], np.int32) for c in chunks])[order])
        assert [g.tolist() for g in got] == [w.tolist() for w in want]


@pytest.mark.parametrize("seed", SEEDS)
def test_run_starts_and_ends_equal_the_diff_formulations(seed: int) -> None:
    # GIVEN frame numbers in runs (sorted or not, one value up to many, negative ones too)
    rng = np.random.default_rng(seed)
    for _ in range(50):
        idx = rng.integers(-3, int(rng.choice([1, 4, 1000])), int(rng.integers(1, 400))).astype(np.int64)
        if rng.random() < 0.7:
            idx = np.sort(idx)
        # THEN the run starts and ends are what np.diff made of them
        assert cells.run_starts(idx).tolist() == np.flatnonzero(np.diff(idx, prepend=idx[0] - 1)).tolist()
        assert cells.run_ends(idx).tolist() == np.append(np.flatnonzero(np.diff(idx)), len(idx) - 1).tolist()


def _fed(decoder: FrameDecoder, stream: bytes, cuts: list[int]) -> tuple[Any, ...]:
    """What a decoder returns fed ``stream`` cut at ``cuts`` (up to the damage, if any); the bytes it
    holds back then, counting those it was not fed (a broken decoder is fed no more)."""
    got: list[tuple[Any, ...]] = []
    fed = 0
    for lo, hi in zip([0, *cuts], [*cuts, len(stream)]):
        if decoder.error is not None:
            break
        got += [(f.type, f.tag, f.payload, f.offset) for f in decoder.feed(stream[lo:hi])]
        fed = hi
        assert decoder.offset + decoder.pending == fed
    return got, str(decoder.error), decoder.offset, decoder.pending + len(stream) - fed


@pytest.mark.parametrize("seed", SEEDS)
def test_frames_read_out_of_the_pieces_equal_frames_gathered_from_small_pieces(seed: int) -> None:
    # GIVEN a stream of frames of many sizes, now and then damaged (a flipped byte, a huge length, a cut)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        parts = [PREAMBLE]
        for _ in range(int(rng.integers(0, 40))):
            recs = np.zeros(int(rng.integers(0, 300)), MEMCPY_DTYPE)
            recs["start"] = rng.integers(0, 1 << 60, len(recs))
            parts.append(encode_batch(RecordKind.MEMCPY, recs) if rng.random() < 0.8
                         else encode_json(FrameType.MARK, {"label": "x" * int(rng.integers(0, 50))}))
        stream = bytearray(b"".join(parts))
        if rng.random() < 0.4 and len(stream) > 8:
            stream[int(rng.integers(0, len(stream)))] ^= 0xFF
        if rng.random() < 0.3:
            stream = stream[: int(rng.integers(0, len(stream) + 1))]
        data = bytes(stream)
        # WHEN it is fed in random pieces, in one piece, and in pieces of a few bytes (every frame gathered in
        # the buffer)
        pieces = sorted(rng.integers(0, len(data) + 1, int(rng.integers(0, 12))).tolist())
        one = _fed(FrameDecoder(), data, [])
        # THEN the frames, their offsets, the damage and what is left over are the same
        assert _fed(FrameDecoder(), data, pieces) == one
        small = np.cumsum(rng.integers(1, 97, len(data) // 20 + 1))
        assert _fed(FrameDecoder(), data, small[small < len(data)].tolist()) == one


def _footprint_state(fp: DeviceFootprint, levels: Any) -> tuple[Any, ...]:
    walked: dict[int, int] = {}
    for entry in fp.live.values():
        walked[entry[1]] = walked.get(entry[1], 0) + 1
    assert fp.live_counts() == walked  # the counts kept as the table changes, as a walk gives them
    return ({a: tuple(e) for a, e in fp.live.items()}, list(fp.live_by_kind),
            fp.async_device_bytes, list(fp.allocations), list(fp.releases), list(fp.allocated_bytes),
            list(fp.released_bytes), fp.peaks.frames(), fp.peaks.level, levels.ts.tolist(), levels.deltas.tolist(),
            levels.level_after)


def _well_formed_batch(rng: np.random.Generator, t: int, live: dict[int, int], one_kind: bool,
                       with_async: bool) -> np.ndarray:
    """Records the bulk path takes: per address allocations and releases alternate, starting from what
    ``live`` (address -> kind) holds; one memory kind or several, stream-ordered ones or none."""
    kinds = [MemoryKind.DEVICE.value] if one_kind else [MemoryKind.DEVICE.value, MemoryKind.PINNED.value, 5]
    rows = []
    for addr in rng.choice(4096, int(rng.integers(200, 600)), replace=False).tolist():
        addr = addr * 4096 + 4096
        for _ in range(int(rng.integers(1, 4))):
            if addr in live:
                rows.append((MemoryOp.RELEASE.value, addr, live.pop(addr)))
            else:
                live[addr] = int(rng.choice(kinds))
                rows.append((MemoryOp.ALLOCATION.value, addr, live[addr]))
    order = rng.permutation(len(rows))
    recs = np.zeros(len(rows), MEMORY_DTYPE)
    # Time order keeps each address's own order: the rows of one address are numbered as they were made.
    seq = np.empty(len(rows), np.int64)
    seq[order] = np.arange(len(rows))
    by_addr: dict[int, list[int]] = {}
    for i, (_, a, _) in enumerate(rows):
        by_addr.setdefault(a, []).append(int(seq[i]))
    for a, stamps in by_addr.items():
        stamps.sort()
    slot = {a: 0 for a in by_addr}
    for i, (op, a, k) in enumerate(rows):
        pos = by_addr[a][slot[a]]
        slot[a] += 1
        recs[pos] = (t + pos * 1000, a, int(rng.choice([512, 4096, 1 << 20])) if op == 1 else 0, 0, 0, 0, 0, 1, 0,
                     0, 0, pos, op, k, int(with_async and rng.random() < 0.5), 0)
    return recs


@pytest.mark.parametrize("seed", SEEDS)
def test_footprint_batches_of_one_kind_without_async_equal_the_per_record_kinds(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN three footprints fed the same well-formed batches (one memory kind or several, stream-ordered
    # allocations or none, releases with their size, without it, or with another one), one with the
    # bulk path's shortcut for one kind without async switched off, one on the C core
    rng = np.random.default_rng(seed)
    fps = [DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS), native=on) for on in (False, False, True)]
    assert fps[2]._core is not None
    errs = [table_mod.IngestErrors(), table_mod.IngestErrors(), table_mod.IngestErrors()]
    live: dict[int, int] = {}
    t = 10**15
    shortcut = 0
    for _ in range(25):
        batch = _well_formed_batch(rng, t, live, one_kind=seed % 2 == 0 or rng.random() < 0.3,
                                   with_async=rng.random() < 0.3)
        rel = batch["op"] == MemoryOp.RELEASE.value
        batch["bytes"][rel & (rng.random(len(batch)) < 0.05)] = 12345  # a release claiming another size
        t += 10**9
        states = []
        for fp, err, on in zip(fps, errs, (True, False, True)):
            monkeypatch.setattr(table_mod, "_UNIFORM_FAST", on)
            levels = fp._apply_memory_native(batch, err, False) if fp._core else fp._apply_memory_bulk(batch, err)
            assert levels is not None  # the bulk path took it
            states.append((_footprint_state(fp, levels), list(fp.live), dict(err.counts)))
        monkeypatch.undo()
        shortcut += len(np.unique(batch["mk"])) == 1 and not batch["is_async"].any()
        # THEN all hold the same table (in the same order), sums, peaks and errors, and returned the same level
        # changes (the third: the C core, which has no shortcut)
        assert states[0] == states[1] == states[2]
    assert shortcut < 25 and (shortcut > 0 or seed % 2)  # both paths were taken


@pytest.mark.parametrize("path", ["numpy", "c"])
@pytest.mark.parametrize("seed", SEEDS)
def test_footprint_batches_in_bulk_leave_the_live_table_the_per_record_walk_leaves(seed: int, path: str) -> None:
    # GIVEN two footprints fed the same well-formed batches, records in no address order (one memory kind
    # or several, stream-ordered allocations or none), one through the bulk path (numpy, or the C core's
    # in the numpy path's order), one record by record
    rng = np.random.default_rng(seed)
    fps = [DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS), native=path == "c") for _ in range(2)]
    assert (fps[0]._core is not None) == (path == "c")
    errs = [table_mod.IngestErrors(), table_mod.IngestErrors()]
    live: dict[int, int] = {}
    t = 10**15
    for _ in range(25):
        batch = _well_formed_batch(rng, t, live, one_kind=rng.random() < 0.5, with_async=rng.random() < 0.5)
        t += 10**9
        bulk = (fps[0]._apply_memory_native(batch, errs[0], False) if path == "c"
                else fps[0]._apply_memory_bulk(batch, errs[0]))
        assert bulk is not None  # the bulk path took it
        each = fps[1]._apply_memory_each(batch, errs[1])
        # THEN both hold the same table (each entry's size, kind, time and async flag, of the same types),
        # sums, peaks and errors, and returned the same level changes
        assert _footprint_state(fps[0], bulk) == _footprint_state(fps[1], each)
        assert [tuple(map(type, e)) for e in fps[0].live.values()] == [tuple(map(type, e)) for e in fps[1].live.values()]
        assert dict(errs[0].counts) == dict(errs[1].counts)


@pytest.mark.parametrize("seed", SEEDS)
def test_frame_counters_from_the_peaks_runs_equal_their_own_runs(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN two footprints with a frame builder each, fed the same memory batches in time order; one
    # builder reads the footprint's own peaks (their runs), the other a peaks table of its own that is
    # never fed (it cuts every batch into frames itself)
    rng = np.random.default_rng(seed)
    fps = [DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS)) for _ in range(2)]
    builders = [FrameBuilder(1, 0, fps[0].peaks, keep_ns=200 * MS, migration_ns=50 * MS, reuse_capacity=1000),
                FrameBuilder(1, 0, FramePeaks(10 * MS, 300 * MS), keep_ns=200 * MS, migration_ns=50 * MS,
                             reuse_capacity=1000)]
    t = 10**15
    shared = 0
    cut: list[int] = []  # batches the builders cut into frames themselves
    own_runs = frames_mod._runs
    monkeypatch.setattr(frames_mod, "_runs", lambda idx: (cut.append(len(idx)), own_runs(idx))[1])
    for _ in range(60):
        batch = memory_batch(rng, t, int(rng.integers(1, 700)), 64, sizeless=False)
        batch = batch[np.argsort(batch["ts"], kind="stable")]
        batch["bytes"] = np.minimum(batch["bytes"], np.uint64(1 << 42))  # validated sizes (ingest)
        t += int(rng.integers(1, 120)) * MS
        states = []
        for fp, builder in zip(fps, builders):
            levels = fp.apply_memory(batch, table_mod.IngestErrors())
            shared += builder.peaks.runs is not None
            builder.on_levels(levels.ts, levels.deltas, levels.level_after)
            cut.clear()
            builder.on_memory(batch)
            # (the builder on the footprint's peaks reads their runs of a large batch: another view of
            # the same times)
            assert (cut == []) == (builder is builders[0] or len(batch) <= frames_mod.SMALL_BATCH)
            states.append((list(builder._frames.items()), list(builder._end_level.items()), builder._newest_frame))
        # THEN both builders hold the same rows and end levels, in the same order
        assert states[0] == states[1]
        # AND the footprint's peaks hold nothing of the batch once the frames took it
        assert fps[0].peaks.runs is None
    assert shared > 5


@pytest.mark.parametrize("seed", SEEDS)
def test_field_checks_with_column_bounds_flag_what_the_per_record_checks_flag(seed: int) -> None:
    # GIVEN batches of copies, sets, kernels and unified-memory records, most inside every limit, some with
    # sizes, devices or durations out of range (and unified-memory page faults, whose value is an address)
    rng = np.random.default_rng(seed)
    limits = Limits(max_record_bytes=1 << 30, max_devices_per_process=4)
    for _ in range(40):
        kind = [RecordKind.MEMCPY, RecordKind.MEMSET, RecordKind.KERNEL, RecordKind.UNIFIED_MEMORY][int(rng.integers(4))]
        recs = np.zeros(int(rng.integers(1, 300)), DTYPES[kind])
        n = len(recs)
        odd = rng.random() < 0.5
        recs["start"] = 10**18 + rng.integers(0, 10**12, n)
        recs["end"] = recs["start"] + rng.integers(-1000, 10**9, n)
        if odd:
            recs["end"][rng.random(n) < 0.02] += np.uint64(4000 * 10**9)  # over an hour
        for name in set(_BYTES[kind]):
            recs[name] = rng.integers(0, 1 << 30, n) + (odd and rng.random() < 0.5) * (rng.random(n) < 0.05) * (1 << 40)
        for name in _DEVICES.get(kind, ("dev",)):
            recs[name] = rng.integers(0, 4 + (odd and rng.random() < 0.5), n)
        if kind is RecordKind.UNIFIED_MEMORY:
            recs["ck"] = rng.choice([1, 3, 4], n)
        seen: list[tuple[str, int]] = []
        kept = check_fields(kind, recs, limits, lambda reason, _text, k, seen=seen: seen.append((reason, k)))
        # THEN the records kept and the problems counted are those of every record checked one by one
        bad = np.zeros(n, bool)
        want: list[tuple[str, int]] = []
        for name in _BYTES[kind]:
            over = recs[name] > np.uint64(limits.max_record_bytes)
            if kind is RecordKind.UNIFIED_MEMORY:
                over &= recs["ck"] != UM_CPU_PAGE_FAULT_COUNT
            if over.any():
                want.append(("bad_size", int((over & ~bad).sum())))
                bad |= over
        for name in _DEVICES.get(kind, ("dev",)):
            over = recs[name] >= limits.max_devices_per_process
            if over.any():
                want.append(("bad_device", int((over & ~bad).sum())))
                bad |= over
        long = (recs["end"] > recs["start"]) & ((recs["end"] - recs["start"]) > np.uint64(MAX_DURATION_NS))
        if long.any():
            want.append(("bad_duration", int((long & ~bad).sum())))
            bad |= long
        assert seen == want
        assert kept.tobytes() == recs[~bad].tobytes()


@pytest.mark.parametrize("seed", SEEDS)
def test_few_burst_frames_judged_in_python_equal_the_numpy_judgement(seed: int) -> None:
    # GIVEN random stretches of a few burst frames, dense or sparse (hundreds of events a frame, or none),
    # levels near and far from the window's baseline, windows young and about to reach burst_max_ms
    rng = np.random.default_rng(seed)
    for _ in range(200):
        cfg = SamplerConfig(burst_settle_ms=int(rng.choice([0, 10, 100])), burst_min_frames=int(rng.integers(1, 6)),
                            burst_max_ms=int(rng.choice([20, 300, 2000])), rate_min_events=int(rng.choice([1, 3, 50])),
                            enabled=bool(rng.random() < 0.95))
        stretch = burst_stretch(rng, max_frames=9, n_ahead=lambda: int(rng.choice([0, 5, 300, 2000])), other_max=300)
        # THEN judging them in Python, their events found with numpy, judges as numpy does
        want = burst_mod.judge_frames(cfg, *stretch)
        assert burst_mod.judge_few_frames(cfg, *stretch) == want


@pytest.mark.parametrize("seed", SEEDS)
def test_burst_frames_judged_with_numpy_equal_the_frame_by_frame_walk(seed: int) -> None:
    # GIVEN random stretches of up to sixty burst frames (a large batch's burst: a thousand events in forty
    # frames, most of them empty), events right at the frames' ends now and then, late and early windows,
    # volatile and calm stretches, the sampler on or off
    rng = np.random.default_rng(seed)
    for _ in range(200):
        cfg = SamplerConfig(burst_settle_ms=int(rng.choice([0, 10, 100])), burst_min_frames=int(rng.integers(1, 6)),
                            burst_max_ms=int(rng.choice([20, 300, 2000])), rate_min_events=int(rng.choice([1, 3, 50])),
                            volatile_min_bytes=int(rng.choice([1, 1 << 20, 64 << 20])),
                            enabled=bool(rng.random() < 0.95))
        # (a first event a few frames in, now and then)
        stretch = burst_stretch(rng, max_frames=61, n_ahead=lambda: int(rng.choice([0, 5, 60, 1200])), other_max=300,
                                late_frames=(0, 3), calm_max=25)
        # THEN numpy's judgement of all of them at once is the Python walk's, frame after frame
        want = burst_mod.walk_frames(cfg, *as_lists(stretch))
        assert burst_mod.judge_frames(cfg, *stretch) == want


def _sampler_state(s: ProcessSampler) -> tuple[Any, ...]:
    return (s.intervals(), s.closed_windows, s.last_peak, s.level_dev, s.level, s.mode, s.interval_ns,
            s.cursor, s.bursts, s.rate_ewma, s.range_ewma, s.window)


@pytest.mark.parametrize("seed", range(40))
def test_large_batch_bursts_judged_ahead_leave_what_walking_them_one_by_one_leaves(seed: int) -> None:
    # GIVEN a process quiet for seconds, then a large batch: clusters of up to hundreds of level changes and
    # other events, some frames apart, some far apart (windows that close in the calm frames before the next
    # cluster), on one or several devices, fed with watermarks that fall anywhere
    rng = np.random.default_rng(seed)
    cfg = SamplerConfig(burst_settle_ms=int(rng.choice([0, 30, 100])), burst_min_frames=int(rng.integers(1, 6)),
                        burst_max_ms=int(rng.choice([40, 300, 2000])))
    bulk, walk, judged = ProcessSampler(1, cfg), ProcessSampler(1, cfg), ProcessSampler(1, cfg)
    walk.bulk_bursts = False
    judged.walk_bursts = False
    samplers = (bulk, walk, judged)
    t = 10**12
    devices = 1 if seed % 2 else 3
    last_mark = 0
    for _ in range(30):
        t = last_mark + int(rng.integers(1, 4000)) * MS  # quiet
        parts = []
        for _ in range(int(rng.integers(1, 10))):
            t += int(rng.choice([0, 1, 5, 10, 15, 20, 150])) * MS + int(rng.integers(0, 5 * MS))
            parts.append(t + np.sort(rng.integers(0, int(rng.choice([1, 5, 15])) * MS, int(rng.integers(1, 300)))))
        ts = np.sort(np.concatenate(parts))  # in time order, as add_levels takes them
        deltas = rng.choice([1 << 20, -(1 << 20), 64 << 20, -(64 << 20), 4 << 10], len(ts))
        dev = int(rng.integers(0, devices))
        other = np.sort(rng.choice(ts, int(rng.integers(0, len(ts) + 1))))
        for s in samplers:
            s.add_levels(ts, deltas, dev)
            if len(other):
                s.add_events(other)
        t = int(ts[-1])
        marks = sorted(t - rng.integers(0, 400, int(rng.integers(1, 4))) * MS) + [t + int(rng.integers(1, 300)) * MS]
        for mark in marks:
            last_mark = max(last_mark, int(mark))  # in time order, and no record comes before one
            for s in samplers:
                s.advance(last_mark)
            # THEN after every watermark all hold the same intervals, windows, peaks, levels and mode
            assert _sampler_state(bulk) == _sampler_state(walk) == _sampler_state(judged)
    for s in samplers:
        s.finish(t + 5000 * MS)
    assert _sampler_state(bulk) == _sampler_state(walk) == _sampler_state(judged)
    assert walk.bursts > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_what_a_burst_walk_reads_before_it_makes_lists_is_what_the_lists_would_say(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN random timelines (ties, runs of equal times), random starts and ends of a stretch, a few or many
    # events allowed, and waiting level changes (each chunk in time order) and events (in any order)
    rng = np.random.default_rng(seed)
    for _ in range(300):
        walk_events = int(rng.choice([0, 1, 3, 64]))
        monkeypatch.setattr(state_mod, "_WALK_EVENTS", walk_events)
        ts = np.sort(rng.integers(0, int(rng.choice([5, 100, 10**6])), int(rng.integers(0, 150)))).astype(np.int64)
        i = int(rng.integers(0, len(ts) + 1))
        stop = int(rng.integers(-2, 10**6 + 2))
        # THEN "at most _WALK_EVENTS events from i before stop" is the count's answer
        assert state_mod._few_before(ts, i, stop) == (int((ts[i:] < stop).sum()) <= walk_events)
        if i < len(ts):
            other = np.sort(rng.integers(0, 10**6, int(rng.integers(1, 5)))).astype(np.int64)
            j = int(rng.integers(0, len(other) + 1))
            assert state_mod._first(ts, i, other, j) == int(np.concatenate([ts[i:], other[j:]]).min())
        s = ProcessSampler(1, SamplerConfig())
        for _ in range(int(rng.integers(0, 4))):
            chunk = np.sort(rng.integers(0, 1000, int(rng.integers(0, 6))))
            s.add_levels(chunk, np.ones(len(chunk), np.int64), 0)
        for _ in range(int(rng.integers(0, 3))):
            s.add_events(rng.integers(0, 1000, int(rng.integers(0, 6))))
        everything = [c[0] for c in s._mem] + s._events
        waiting = np.concatenate(everything).tolist() if everything else []
        # The cursor at random, or at a waiting time (a time at the cursor is not before it), or just past one.
        cursor = int(rng.integers(0, 1000)) if not waiting or rng.random() < 0.4 else \
            int(rng.choice(waiting)) + int(rng.integers(0, 2))
        # THEN "nothing waiting before the cursor" reads every waiting time
        assert s._nothing_before(cursor) == all(bool((c >= cursor).all()) for c in everything)


@pytest.mark.parametrize("seed", SEEDS)
def test_pool_sizes_of_one_pool_read_from_columns_equal_the_per_pool_runs(seed: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN three footprints fed the same large MEMORY batches (past the record-by-record size): mostly
    # every stream-ordered record of one pool, its size the same or moving inside the batch or against the
    # table, now and then several pools, records without a pool or a size among them, or none with one
    rng = np.random.default_rng(seed)
    fps = [DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS)) for _ in range(2)]
    ref_pools: dict[int, tuple[int, int]] = {}
    ref_floor = 0
    one_pool = 0
    for _ in range(40):
        n = int(rng.integers(table_mod._SMALL_POOL_BATCH + 1, 700))
        recs = np.zeros(n, MEMORY_DTYPE)
        pools = [0x100] if rng.random() < 0.7 else [0x100, 0x200, 0x300]
        recs["pool_addr"] = rng.choice(pools + [0] * int(rng.integers(0, 3)), size=n)
        sizes = [1 << 20] if rng.random() < 0.5 else [1 << 20, 2 << 20]
        recs["pool_size"] = rng.choice(sizes + [0] * int(rng.integers(0, 2)), size=n)
        recs["pool_used"] = rng.integers(0, 1 << 20, size=n)
        if rng.random() < 0.1:
            recs["pool_addr"] = 0
        asyncs = int(rng.integers(0, 1 << 30))
        for a, s, u in zip(recs["pool_addr"].tolist(), recs["pool_size"].tolist(), recs["pool_used"].tolist()):
            if a and s:
                if ref_pools.get(a, (None,))[0] != s:
                    ref_floor = asyncs
                ref_pools[a] = (s, u)
        one_pool += len(np.unique(recs["pool_addr"][(recs["pool_addr"] != 0) & (recs["pool_size"] != 0)])) == 1
        for fp, on in zip(fps, (True, False)):
            fp.async_device_bytes = asyncs
            monkeypatch.setattr(table_mod, "_ONE_POOL_FAST", on)
            fp.note_pool_config(recs)
        monkeypatch.undo()
        # THEN the pools read from the columns are the per-pool runs' (dict order included) and the
        # record-by-record rule's, and so is the floor
        assert list(fps[0].pools.items()) == list(fps[1].pools.items()) and fps[0].pools == ref_pools
        assert fps[0].pool_floor == fps[1].pool_floor == ref_floor
    assert 0 < one_pool < 40  # both paths were taken
