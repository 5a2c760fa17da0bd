"""The footprint's MEMORY batches through the C core (native/core.c gfp_bulk_*) leave exactly what the
Python paths leave.

``DeviceFootprint.apply_memory`` with the C core takes batches of at least ``_NATIVE_MIN`` records into C:
below ``_BULK_MIN`` it must leave what the per-record loop ``_apply_memory_each`` leaves (dict order and the
first mismatch logged included), from ``_BULK_MIN`` on what the numpy path ``_apply_memory_bulk`` leaves,
and where either would answer None (an anomaly) nothing may have changed before the per-record loop runs.
Here a footprint on the C core and one on the Python paths (``native=False``) are fed the same random
batches, anomalies included, and their whole state compared after every batch.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gpufootprint import native
from gpufootprint.footprint import table as table_mod
from gpufootprint.footprint.peaks import FramePeaks
from gpufootprint.footprint.table import DeviceFootprint, IngestErrors
from gpufootprint.records import LATE_RELEASE_NS, MEMORY_DTYPE

from tests.native import shim as native_shim

MS = 1_000_000
A, R = 1, 2


def _library() -> None:
    lib, why = native.load()
    assert lib is not None, f"{why} (README's install builds the daemon's C core where a C compiler exists)"


class RecordedErrors(IngestErrors):
    """Counts, the detail each reason would log (its first one), and each reason's first detail since
    ``batch`` was last cleared (the per-record path adds a mismatch at a time, the bulk paths all of a
    batch's at once with the first one's detail: per batch, the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[str, str] = {}
        self.batch: dict[str, str] = {}

    def add(self, reason: str, detail: str, n: int = 1) -> None:
        self.first.setdefault(reason, detail)
        self.batch.setdefault(reason, detail)
        super().add(reason, detail, n)


def _footprint(on: bool) -> DeviceFootprint:
    fp = DeviceFootprint(pid=7, dev=0, peaks=FramePeaks(10 * MS, 300 * MS), native=on)
    assert (fp._core is not None) == on
    return fp


def state(fp: DeviceFootprint, errors: RecordedErrors, levels: Any) -> tuple[Any, ...]:
    """Everything the footprint holds (the live table in its order, each entry's value types), the errors'
    counts, repairs and logged details, and the level changes the batch returned."""
    return (list(fp.live.items()), [tuple(map(type, e)) for e in fp.live.values()], list(fp.live_by_kind),
            list(fp.live_count_by_kind), fp.async_device_bytes, list(fp.allocations), list(fp.releases),
            list(fp.allocated_bytes), list(fp.released_bytes), fp.pool_floor, dict(fp.pools), fp.last_ts,
            list(fp.reused._reuses.items()), fp.peaks.frames(), fp.peaks.level, fp.peaks._open_idx,
            fp.peaks._open_peak, dict(errors.counts), dict(errors.repairs), dict(errors.first), dict(errors.batch),
            None if levels is None else (levels.ts.tolist(), levels.deltas.tolist(), levels.deltas.dtype,
                                         levels.level_after))


KINDS = [3, 3, 3, 3, 2, 1, 5, 6, 0, 31]  # device mostly; pinned, pageable, managed, static, unknown, the last one
SIZES = [512, 4096, 1 << 20, 20 << 20, 1 << 40, (1 << 53) - 1, 1 << 61, (1 << 62) + 12345]


def batch(rng: np.random.Generator, t: int, n: int, live: dict[int, Any], pool: list[int], p_bad: float,
          huge: bool, claim_big: bool = False) -> np.ndarray:
    """``n`` MEMORY records in time order over a few addresses: per address allocations and releases
    alternating from what ``live`` holds (the well-formed batch), with anomalies at rate ``p_bad``: an
    allocation at a live address, a release of an address not live, two releases in a row, a release
    claiming another size, kinds >= 32, an unknown op; mixed kinds, stream-ordered allocations, releases
    without their size, addresses in no order, huge sizes (``huge``: sums past 2**53 and 2**63, sizes of
    2**63 and more), releases claiming a size of 2**63 and more (``claim_big``)."""
    addrs = rng.choice(pool, min(len(pool), max(1, n // int(rng.choice([1, 2, 3])))), replace=False).tolist()
    per: dict[int, list[tuple[int, int, int, int, int]]] = {a: [] for a in addrs}  # (op, bytes, kind, async)
    held = {a: a in live for a in addrs}
    sizes = SIZES if huge else SIZES[:4]
    for _ in range(n):
        a = addrs[int(rng.integers(len(addrs)))]
        op = R if held[a] else A
        if rng.random() < p_bad:
            op = int(rng.choice([A, R, 7]))
        kind = int(rng.choice(KINDS))
        if rng.random() < p_bad / 4:
            kind = int(rng.choice([32, 200]))
        size = int(rng.choice(sizes))
        if huge and rng.random() < 0.01:
            size = (1 << 63) + int(rng.integers(0, 1 << 20))
        if op == R:
            size = 0 if rng.random() < 0.3 else (int(rng.choice(sizes)) if rng.random() < p_bad else -1)
            if claim_big and rng.random() < 0.01:
                size = (1 << 63) + 7  # a release claiming a size past int64 (the numpy path logs it wrapped)
        per[a].append((op, size, kind, int(rng.random() < 0.3), 0))
        held[a] = op == A if op in (A, R) else held[a]
    # a release claims its allocation's size (-1 above): the last allocation in the batch, or the live entry's
    rows: list[tuple[int, int, int, int, int]] = []
    for a, recs in per.items():
        last = live[a][0] if a in live else 512
        for op, size, kind, asy, _ in recs:
            if op == A:
                last = size
            elif op == R and size == -1:
                size = last if 0 <= last < (1 << 64) else 0
            rows.append((a, op, size, kind, asy))
    # interleave the addresses' sequences at random, each in its own order
    order = np.argsort(rng.random(len(rows)), kind="stable")
    seqs: dict[int, list[int]] = {}
    for i, (a, *_r) in enumerate(rows):
        seqs.setdefault(a, []).append(i)
    slots = sorted(range(len(rows)), key=lambda i: order[i])
    taken: dict[int, int] = {a: 0 for a in seqs}
    out = np.zeros(len(rows), MEMORY_DTYPE)
    step = int(rng.choice([0, 1, 1000]))
    for pos, i in enumerate(slots):
        a = rows[i][0]
        j = seqs[a][taken[a]]
        taken[a] += 1
        a, op, size, kind, asy = rows[j]
        out[pos] = (t + pos * step, a, size, 0, 0, 0, 0, 7, 0, 0, 0, 1000 + pos, op, kind, asy, 0)
    return out


def _pool(rng: np.random.Generator) -> list[int]:
    base = [0x7F0000000000 + i * 0x200000 for i in range(int(rng.choice([8, 256, 4096], p=[0.2, 0.4, 0.4])))]
    return base + [0, 512, (1 << 64) - 4096, (1 << 63) + 4096]


def _apply(fp: DeviceFootprint, recs: np.ndarray, errors: RecordedErrors) -> tuple[Any, Any]:
    try:
        return fp.apply_memory(recs, errors), None
    except OverflowError as exc:  # a size of 2**63 or more in the table meets the numpy path (both raise)
        return None, type(exc)


@pytest.mark.parametrize("seed", range(16))
def test_the_c_core_leaves_what_the_python_paths_leave_after_every_batch(seed: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a footprint on the C core and one on the Python paths (numpy for large batches, per record for
    # small ones), fed the same random batches of 1 to 3,000 records with anomalies now and then; every
    # third seed with the C core taking batches from 1 record on (the per-record path's order)
    _library()
    rng = np.random.default_rng(seed)
    if seed % 3 == 2:
        monkeypatch.setattr(table_mod, "_NATIVE_MIN", 1)
    taken = {"c": 0, "each_order": 0, "none": 0, "numpy": 0}
    real_native, real_bulk = DeviceFootprint._apply_memory_native, DeviceFootprint._apply_memory_bulk

    def spy_native(self: DeviceFootprint, recs: np.ndarray, errors: IngestErrors, each_order: bool) -> Any:
        got = real_native(self, recs, errors, each_order)
        taken["none" if got is None else "each_order" if each_order else "c"] += 1
        return got

    def spy_bulk(self: DeviceFootprint, recs: np.ndarray, errors: IngestErrors) -> Any:
        taken["numpy"] += self._core is not None
        return real_bulk(self, recs, errors)

    monkeypatch.setattr(DeviceFootprint, "_apply_memory_native", spy_native)
    monkeypatch.setattr(DeviceFootprint, "_apply_memory_bulk", spy_bulk)
    c, py = _footprint(True), _footprint(False)
    ec, ep = RecordedErrors(), RecordedErrors()
    pool = _pool(rng)
    t = 10**15
    for _ in range(60):
        n = int(rng.choice([int(rng.integers(1, 64)), int(rng.integers(64, 192)), int(rng.integers(192, 3000))],
                           p=[0.3, 0.3, 0.4]))
        p_bad = float(rng.choice([0.0, 0.0, 0.0, 0.0005, 0.05]))
        recs = batch(rng, t, n, py.live, pool, p_bad, huge=rng.random() < 0.15, claim_big=rng.random() < 0.1)
        how = rng.random()
        if how < 0.15:
            recs = np.frombuffer(recs.tobytes(), MEMORY_DTYPE)  # read-only, as decoded off the wire
        elif how < 0.2:
            recs = np.repeat(recs, 2)[::2]  # a strided view (the C reads the records where they lie)
        t += int(rng.choice([1000, 10 * MS, 2 * LATE_RELEASE_NS]))
        ec.batch.clear()
        ep.batch.clear()
        got_c, got_py = _apply(c, recs, ec), _apply(py, recs, ep)
        # THEN both hold the same state, errors and level changes after every batch (or raised alike)
        assert got_c[1] == got_py[1]
        assert state(c, ec, got_c[0]) == state(py, ep, got_py[0])
    assert taken["c"] > 0 and taken["each_order"] > 0 and taken["none"] > 0, taken


def _well_formed(rng: np.random.Generator, t: int, n: int, live: set[int], span: int) -> np.ndarray:
    """A batch the C core takes: releases of live addresses, allocations of new ones, in no address order."""
    recs = np.zeros(n, MEMORY_DTYPE)
    rel = [live.pop() for _ in range(min(len(live), n // 2))]
    new: list[int] = []
    while len(new) < n - len(rel):
        a = int(rng.integers(1, span)) * 4096
        if a not in live and a not in new and a not in rel:
            new.append(a)
    live.update(new)
    recs["ts"] = t + np.arange(n)
    recs["addr"] = rel + new
    recs["op"] = [R] * len(rel) + [A] * len(new)
    recs["bytes"][len(rel):] = rng.choice([512, 4096, 1 << 20], len(new))
    recs["mk"] = 3
    recs["is_async"] = rng.random(n) < 0.5
    return recs[rng.permutation(n)]


@pytest.mark.parametrize("n", [1, 63, 64, 191, 192, 4096, 9000])
def test_each_batch_size_takes_the_path_the_python_side_takes(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN well-formed batches (every one taken by the C core from _NATIVE_MIN on, the workspace kept up
    # to 8,192 records and made anew past it)
    _library()
    rng = np.random.default_rng(n)
    c, py = _footprint(True), _footprint(False)
    ec, ep = RecordedErrors(), RecordedErrors()
    live: set[int] = set()
    calls = []
    real = DeviceFootprint._apply_memory_native
    monkeypatch.setattr(DeviceFootprint, "_apply_memory_native",
                        lambda self, r, e, o: calls.append(o) or real(self, r, e, o))
    for i in range(4):
        recs = _well_formed(rng, 10**15 + i * 10**9, n, live, 1 << 20)
        assert state(c, ec, c.apply_memory(recs, ec)) == state(py, ep, py.apply_memory(recs, ep))
    # THEN the C core took them, in the per-record path's order below _BULK_MIN
    assert calls == ([] if n < table_mod._NATIVE_MIN else [n < table_mod._BULK_MIN] * 4)


def test_footprints_in_several_threads_keep_their_batches_apart() -> None:
    # GIVEN footprints on the C core in four threads, each fed its own batches while the others run (the
    # two calls of a batch share a per-thread workspace; a thread may switch between them)
    _library()
    out: dict[int, list[Any]] = {}

    def run(k: int, on: bool) -> None:
        rng = np.random.default_rng(k)
        fp, err = _footprint(on), RecordedErrors()
        live: set[int] = set()
        got = []
        for i in range(40):
            recs = _well_formed(rng, 10**15 + i * 10**9, int(rng.integers(64, 2000)), live, 1 << 16)
            got.append(state(fp, err, fp.apply_memory(recs, err)))
        out[(k, on)] = got  # type: ignore[index]

    threads = [threading.Thread(target=run, args=(k, True)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k in range(4):
        run(k, False)
        # THEN each thread's footprint left what the Python paths leave for its batches
        assert out[(k, True)] == out[(k, False)]  # type: ignore[index]


def test_a_size_mismatch_logs_the_first_in_the_order_of_the_path_it_stands_for() -> None:
    # GIVEN two releases claiming other sizes: at a high address first in time, a low one later
    _library()
    rows = [(i, A, 0x9000 + i * 0x1000, 64) for i in range(200)]
    rows += [(300, R, 0x9000 + 150 * 0x1000, 32), (301, R, 0x9000 + 10 * 0x1000, 16)]
    recs = np.zeros(len(rows), MEMORY_DTYPE)
    for i, (ts, op, addr, size) in enumerate(rows):
        recs[i]["ts"], recs[i]["op"], recs[i]["addr"], recs[i]["bytes"], recs[i]["mk"] = ts, op, addr, size, 3
    for sub, first in ((recs, "addr=0x13000 allocated 64 released 16"),  # numpy: by address
                       (recs[-100:], "addr=0x9f000 allocated 64 released 32")):  # per record: in time order
        c, py = _footprint(True), _footprint(False)
        ec, ep = RecordedErrors(), RecordedErrors()
        for fp, err in ((c, ec), (py, ep)):
            fp.live.update({0x9000 + i * 0x1000: (64, 3, i, False) for i in range(100)} if len(sub) == 100 else {})
            fp.apply_memory(sub, err)
        # THEN both log the same first mismatch and count both
        assert ec.first == ep.first == {"release_size_mismatch": f"pid=7 {first}"}
        assert ec.counts == ep.counts == {"release_size_mismatch": 2}


def test_the_env_switch_and_native_false_leave_the_python_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    _library()
    assert _footprint(True)._core is not None
    assert DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS), native=False)._core is None
    monkeypatch.setenv(native.ENV, "0")
    fp = DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS))
    assert fp._core is None
    rng = np.random.default_rng(1)
    recs = _well_formed(rng, 10**15, 500, set(), 1 << 16)
    monkeypatch.setattr(DeviceFootprint, "_apply_memory_native", None)  # never asked
    fp.apply_memory(recs, IngestErrors())
    assert len(fp.live) == 500


def test_without_the_library_the_footprint_runs_its_python_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    with native_shim.core_at(monkeypatch, native.LIBRARY.with_name("missing.so")):
        fp = DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS))
        assert fp._core is None
        fp.apply_memory(_well_formed(np.random.default_rng(2), 10**15, 500, set(), 1 << 16), IngestErrors())
        assert len(fp.live) == 500


def test_a_library_of_another_build_is_refused_and_the_footprint_uses_python(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # ABI 1: the reuse core's library, before the bulk calls
    with native_shim.core_at(monkeypatch, native_shim.core_of_abi(tmp_path, 1)):
        got, why = native.load()
        assert got is None and why == f"libgfp-core.so: ABI 1, this daemon needs {native._ABI}"
        assert DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS))._core is None


def test_an_apply_without_its_plan_is_refused() -> None:
    _library()
    lib = table_mod._laid_out(native.core())
    recs = _well_formed(np.random.default_rng(3), 10**15, 100, set(), 1 << 16)
    words = np.zeros(2000, np.uint64)
    at = words.ctypes.data
    assert lib.gfp_bulk_plan(recs.ctypes.data, 100, recs.strides[0], at, at + 800) == 0
    # another batch's apply (or a second one) is refused, nothing written
    assert lib.gfp_bulk_apply(recs.ctypes.data, 99, recs.strides[0], at, 0, at, at, at, at, at) == -3
    assert lib.gfp_bulk_apply(recs.ctypes.data, 100, recs.strides[0], at, 0, at, at, at, at, at) == -3


MIX = 0x9E3779B97F4A7C15


def _crafted(n: int) -> np.ndarray:
    """Addresses a process could pick against a fixed multiply-shift hash by MIX: k * MIX^-1, whose products
    with MIX are 1..n and so all share the top bits every table size hashes on (one slot, one run)."""
    inverse = pow(MIX, -1, 1 << 64)
    return np.array([(k * inverse) % (1 << 64) for k in range(1, n + 1)], np.uint64)


def _displacement_of_a_batch(addrs: np.ndarray) -> int:
    recs = np.zeros(len(addrs), MEMORY_DTYPE)
    recs["ts"] = 10**15 + np.arange(len(addrs)) * 1_000
    recs["op"], recs["addr"], recs["bytes"], recs["mk"] = A, addrs, 4096, 3
    fp = _footprint(True)
    fp.apply_memory(recs, IngestErrors())
    assert len(fp.live) == len(addrs)  # the C path took it: every allocation is live
    lib = native.load()[0]
    lib.gfp_bulk_displacement.restype = ctypes.c_uint64
    return int(lib.gfp_bulk_displacement())


def test_addresses_crafted_against_a_fixed_hash_do_not_pile_into_one_run() -> None:
    """The batch's address hash takes a random multiplier (core.c's hash_multiplier): with MIX, 4,096 crafted
    addresses walked 8.4 M slots past their homes (quadratic: seconds of the shared ingest thread for a frame
    of them); random addresses walk about one slot each."""
    _library()
    n = 4096
    crafted = _displacement_of_a_batch(_crafted(n))
    plain = _displacement_of_a_batch(np.random.default_rng(3).integers(1 << 20, 1 << 47, n, dtype=np.uint64))
    assert crafted < 4 * n and plain < 4 * n, (crafted, plain)


def test_a_threads_c_workspace_is_freed_when_the_thread_ends() -> None:
    """Each thread that applies batches gets its own C workspace (up to about 600 KB after an 8,192-record
    batch); it goes with the thread (a key's destructor), where it was kept for the life of the process."""
    _library()
    import os

    def resident_kib() -> int:  # now, not the high-water mark (earlier tests in this process may have set it)
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

    def one() -> None:
        _displacement_of_a_batch(np.random.default_rng(4).integers(1 << 20, 1 << 47, 8192, dtype=np.uint64))

    one()  # this thread's own, and numpy's, made once
    before = resident_kib()
    for _ in range(150):
        t = threading.Thread(target=one)
        t.start()
        t.join()
    grown_kib = resident_kib() - before
    assert grown_kib < 40_000, grown_kib  # kept, 150 workspaces of about 600 KB were about 90 MB
