"""The reuse tracker's C core (gpufootprint/native/core.c) leaves exactly what the Python paths leave.

The Python paths (``_add_small`` for small batches, numpy over features/keyset.py for large ones) are
the reference; tests/unit/test_small_batches.py and test_large_batches.py hold them equal to each other.
Here a tracker on the C core and one on the Python paths are fed the same random batches and compared
after every batch: counts, events, ratio, the remembered sizes and the freed keys.
"""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpufootprint import native
from gpufootprint.features import reuse as reuse_mod
from gpufootprint.features.reuse import ReuseTracker
from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp

from tests.native import shim as native_shim
from tests.random_batches import reuse_state

MIX = 0x9E3779B97F4A7C15
U64 = (1 << 64) - 1
SIZES = np.array([0, 512, 4096, 1 << 20, U64], np.uint64)


def _library() -> None:
    lib, why = native.load()
    assert lib is not None, f"{why} (README's install builds the daemon's C core where a C compiler exists)"


def _batch(rng: np.random.Generator, t: int, n: int, addrs: int, sizeless: bool) -> np.ndarray:
    """Random MEMORY records: few addresses and sizes (keys repeat within and across batches), times out
    of order and equal now and then (the stable sort decides between an allocation and a release of one
    key at one time), mixed memory kinds, unknown ops, releases without their size, and the key 0 (the
    address 0 with the size 0, and an address equal to its size's mix)."""
    recs = np.zeros(n, MEMORY_DTYPE)
    spread = int(rng.choice([20, 50_000_000]))  # 20 ns: many records at one time
    recs["ts"] = t + np.sort(rng.integers(0, spread, n))
    if rng.random() < 0.3 and n > 1:
        recs["ts"] = recs["ts"][rng.permutation(n)]
    recs["op"] = rng.choice([MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value, 7], n, p=[0.5, 0.45, 0.05])
    recs["addr"] = rng.integers(0, addrs, n).astype(np.uint64) * np.uint64(4096)
    recs["bytes"] = rng.choice(SIZES, n, p=[0.05, 0.3, 0.3, 0.3, 0.05])
    zero_key = rng.random(n) < 0.03  # addr ^ (size * MIX) == 0 with a non-zero address
    recs["addr"][zero_key] = (recs["bytes"][zero_key] * np.uint64(MIX))
    if sizeless:
        recs["bytes"][(recs["op"] == MemoryOp.RELEASE.value) & (rng.random(n) < 0.5)] = 0
    recs["mk"] = rng.choice([MemoryKind.DEVICE.value, MemoryKind.PINNED.value, MemoryKind.DEVICE_STATIC.value], n,
                            p=[0.85, 0.1, 0.05])
    return recs


def _shape(rng: np.random.Generator, recs: np.ndarray) -> np.ndarray:
    """The batch as the tracker may be handed it: read-only bytes, a strided or reversed view, or as is."""
    how = rng.random()
    if how < 0.2:
        return np.frombuffer(recs.tobytes(), MEMORY_DTYPE)  # read-only, as decoded off the wire
    if how < 0.3 and len(recs) > 1:
        return recs[::2]
    if how < 0.35:
        return recs[::-1]
    return recs


@pytest.mark.parametrize("seed", range(16))
def test_the_c_core_equals_the_python_paths_on_random_batch_sequences(seed: int) -> None:
    # GIVEN a tracker on the C core and one on the Python paths (small capacity and history now and then:
    # clears and buffer replacements happen), fed the same random batches of 1 to 12,000 records,
    # empty ones and ones without a device record, with share() between batches now and then
    _library()
    rng = np.random.default_rng(seed)
    capacity = int(rng.choice([8, 300, 3000, 100_000]))
    history = int(rng.choice([256, 2048, 1 << 20]))
    c, py = ReuseTracker(capacity, history), ReuseTracker(capacity, history, native=False)
    assert c._core is not None and py._core is None
    t = 10**15
    keys: set[int] = {0}
    zero_freed = False
    for _ in range(50):
        # (past 8,192 records an out-of-order batch's sort scratch is freed after it: core.c SCRATCH_KEEP)
        n = int(rng.choice([0, int(rng.integers(1, 97)), int(rng.integers(97, 300)), int(rng.integers(300, 5000)),
                            int(rng.integers(8000, 12_000))], p=[0.03, 0.5, 0.2, 0.22, 0.05]))
        batch = _shape(rng, _batch(rng, t, n, int(rng.choice([4, 64, 4096])), sizeless=rng.random() < 0.15))
        if rng.random() < 0.05:
            batch = batch.copy()
            batch["mk"] = MemoryKind.PINNED.value  # no device record at all
        t += int(rng.choice([10, 60_000_000]))  # batches overlapping in time, or not
        keys.update(reuse_mod.reuse_keys(batch["addr"], batch["bytes"]).tolist())
        c.add(batch)
        py.add(batch)
        if rng.random() < 0.1:
            part = float(rng.choice([0.001, 0.3, 1.0]))
            c.share(part)
            py.share(part)
        # THEN after every batch both hold the same counts, events, ratio, remembered sizes and freed keys
        probe = sorted(keys)[:300] + sorted(keys)[-100:]
        assert reuse_state(c, probe) == reuse_state(py, probe)
        assert c.events().tobytes() == py.events().tobytes() and not c.events().flags.writeable
        zero_freed |= c._core.has_freed(0)
    assert c.reused > 0 and c.allocations > c.reused
    assert zero_freed or capacity == 8  # the key 0 went through its flag (a capacity of 8 may clear it first)


A, R = MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value


def _rows(rows: list[tuple[int, int, int, int]]) -> np.ndarray:
    """Device records from (ts, op, addr, bytes)."""
    recs = np.zeros(len(rows), MEMORY_DTYPE)
    for i, (ts, op, addr, size) in enumerate(rows):
        recs[i]["ts"], recs[i]["op"], recs[i]["addr"], recs[i]["bytes"] = ts, op, addr, size
    recs["mk"] = MemoryKind.DEVICE.value
    return recs


def _tracker(native_on: bool, capacity: int = 100_000) -> ReuseTracker:
    if native_on:
        _library()
    tr = ReuseTracker(capacity=capacity, native=native_on)
    assert (tr._core is not None) == native_on
    return tr


@pytest.mark.parametrize("native_on", [True, False])
def test_an_allocation_and_a_release_at_one_time_keep_their_order_in_the_batch(native_on: bool) -> None:
    cases = [
        # an earlier record last: the batch is out of order and gets sorted; the tie keeps its order
        ([(5, R, 4096, 64), (5, A, 4096, 64), (1, 7, 0, 0)], [True]),
        ([(5, A, 4096, 64), (5, R, 4096, 64), (1, 7, 0, 0)], [False]),
        # only the first two out of order
        ([(6, A, 4096, 64), (5, R, 4096, 64), (7, A, 8192, 64)], [True, False]),
    ]
    for rows, hits in cases:
        tr = _tracker(native_on)
        tr.add(_rows(rows))
        assert tr.events()["reused"].tolist() == hits, rows


@pytest.mark.parametrize("native_on", [True, False])
def test_the_tables_start_afresh_when_a_batch_finds_them_holding_capacity_keys(native_on: bool) -> None:
    # GIVEN a capacity of 4, and a first batch that leaves 3 or 4 freed keys and remembered sizes (its
    # releases omit their size)
    for held in (3, 4):
        tr = _tracker(native_on, capacity=4)
        tr.add(_rows([(i, A, 4096 * (i + 1), 64) for i in range(held)] +
                     [(10 + i, R, 4096 * (i + 1), 0) for i in range(held)]))
        keys = [4096 * (i + 1) ^ ((64 * MIX) & U64) for i in range(held)]
        assert reuse_state(tr, keys)[3:7] == ({4096 * (i + 1): 64 for i in range(held)}, True, held, [True] * held)
        # WHEN the next batch allocates at the first address again
        tr.add(_rows([(20, A, 4096, 64)]))
        # THEN at 4 both tables started afresh before it (a miss; one size remembered), at 3 neither did
        state = reuse_state(tr, keys)
        if held == 4:
            assert tr.events()["reused"].tolist()[-1] is False and state[3:6] == ({4096: 64}, True, 0)
        else:
            assert tr.events()["reused"].tolist()[-1] is True and state[3:6] == (
                {4096 * (i + 1): 64 for i in range(held)}, True, held)


def test_the_env_switch_turns_the_c_core_off_and_the_python_paths_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN GPUFOOTPRINT_DAEMON_NATIVE=0 with the library built
    _library()
    monkeypatch.setenv(native.ENV, "0")
    tr = ReuseTracker(capacity=300)
    # THEN the tracker has no core, and its Python paths (the numpy one too) count as they did
    assert tr._core is None and native.core() is None
    rng = np.random.default_rng(3)
    on = ReuseTracker(capacity=300, native=True)  # still asks the switch: off
    assert on._core is None
    monkeypatch.delenv(native.ENV)
    ref = ReuseTracker(capacity=300)
    assert ref._core is not None
    for n in (20, 2000, 50):
        batch = _batch(rng, 10**15, n, 64, sizeless=True)
        tr.add(batch)
        ref.add(batch)
    assert tr.events().tolist() == ref.events().tolist() and tr.reused == ref.reused > 0
    assert len(tr._freed) > 0  # the Python set held the keys


def test_without_the_library_the_tracker_runs_its_python_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    with native_shim.core_at(monkeypatch, native.LIBRARY.with_name("missing.so")):
        lib, why = native.load()
        assert lib is None and why == "missing.so was not built with this install (no C compiler?)"
        tr = ReuseTracker()
        assert tr._core is None
        tr.add(_batch(np.random.default_rng(1), 10**15, 500, 8, sizeless=False))
        assert tr.allocations > tr.reused > 0


def test_a_library_of_another_build_is_refused_with_its_reason(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale library beside newer Python (an editable tree not rebuilt) would be called with the wrong
    signatures: its ABI number is checked first, and the tracker falls back to Python."""
    with native_shim.core_at(monkeypatch, native_shim.core_of_abi(tmp_path, 0)):
        got, why = native.load()
        assert got is None and why == f"libgfp-core.so: ABI 0, this daemon needs {native._ABI}"
        assert ReuseTracker()._core is None


def test_the_c_memory_is_freed_with_its_tracker() -> None:
    _library()
    tr = ReuseTracker()
    assert tr._core is not None
    freed = tr._core.freed
    tr.add(_batch(np.random.default_rng(2), 10**15, 3000, 64, sizeless=True))
    del tr
    gc.collect()
    assert not freed.alive  # gfp_reuse_free ran


def test_records_of_another_dtype_with_the_same_fields_are_read_by_name() -> None:
    _library()
    rng = np.random.default_rng(5)
    recs = _batch(rng, 10**15, 400, 16, sizeless=True)
    other = np.zeros(len(recs), [("mk", "u1"), ("op", "u1"), ("bytes", "<u8"), ("addr", "<u8"), ("ts", "<u8")])
    for name in other.dtype.names or ():
        other[name] = recs[name]
    c, py = ReuseTracker(), ReuseTracker(native=False)
    c.add(other)
    py.add(recs)
    assert c.events().tolist() == py.events().tolist() and c.reused == py.reused > 0


@pytest.mark.parametrize("native_on", [True, False])
def test_sizes_are_remembered_from_the_first_batch_with_a_release_without_its_size_on(native_on: bool) -> None:
    # GIVEN a batch whose allocation has the size 0 (not a release: nothing to remember yet)
    tr = _tracker(native_on)
    tr.add(_rows([(1, A, 4096, 0), (2, A, 8192, 64)]))
    assert reuse_state(tr, [])[3:5] == ({}, False)
    # WHEN a later batch releases without its size: from that batch on, sizes are remembered, and that
    # release, whose address's allocation came before, takes the size 0 (its key is the bare address)
    tr.add(_rows([(3, R, 8192, 0), (4, A, 8192, 0), (5, A, 16384, 32)]))
    # THEN the allocation of (8192, 0) after it is a reuse, and only this batch's allocations are remembered
    assert tr.events()["reused"].tolist() == [False, False, True, False]
    assert reuse_state(tr, [])[3:5] == ({8192: 0, 16384: 32}, True)


_FED_AT_EXIT = """
import atexit, threading, time
import numpy as np
from gpufootprint.features.reuse import ReuseTracker
from gpufootprint.records import MEMORY_DTYPE
atexit.register(lambda: time.sleep(0.5))  # runs after the finalizers' exit hook: the thread goes on meanwhile
tr = ReuseTracker(capacity=1 << 20)
assert tr._core is not None
rng = np.random.default_rng(0)
recs = np.zeros(4000, MEMORY_DTYPE)
recs["mk"], recs["bytes"], recs["ts"] = 3, 64, np.arange(len(recs))
recs["op"], recs["addr"] = rng.choice([1, 2], len(recs)), rng.integers(0, 1 << 40, len(recs))
def feed():
    while True:
        recs["addr"] += np.uint64(1 << 41)  # new keys: the tables keep growing
        tr.add(recs)
threading.Thread(target=feed, daemon=True).start()
time.sleep(0.2)
"""


def test_a_tracker_still_fed_by_a_daemon_thread_at_interpreter_exit_does_not_crash_it() -> None:
    """The ingest thread is a daemon thread that App.stop waits for only so long: at exit it may still be
    inside a batch. The C memory must not be freed under it by the finalizers' exit hook (it was: a
    use-after-free, the process killed by SIGSEGV or glibc's abort)."""
    _library()
    from tests.conftest import cli_env

    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", _FED_AT_EXIT], env=cli_env(), capture_output=True, text=True, check=False,
                             timeout=60)
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])


def test_a_library_built_from_another_core_c_than_the_one_beside_it_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited tree not rebuilt would run, and its tests would test, the old C: setup.py compiles the
    source's digest in, and a library whose core.c beside it has changed is refused, with what to do."""
    cc = native_shim.compiler()
    assert cc, "no C compiler"
    source = native.LIBRARY.with_name("core.c").read_bytes()
    (tmp_path / "core.c").write_bytes(source)
    lib = tmp_path / "libgfp-core.so"
    subprocess.run([cc, "-O1", "-std=c11", "-D_GNU_SOURCE", "-pthread", "-shared", "-fPIC", f'-DGFP_CORE_SOURCE="{native.source_digest(source)}"',
                    "-o", str(lib), str(tmp_path / "core.c")], check=True, capture_output=True)
    with native_shim.core_at(monkeypatch, lib):
        got, why = native.load()
        assert got is not None and why == ""  # built from the source beside it
        (tmp_path / "core.c").write_bytes(source + b"\n/* edited */\n")
        native.load.cache_clear()
        got, why = native.load()
        assert got is None and "was built from another core.c" in why and "rebuild it" in why, why
        assert ReuseTracker()._core is None


def test_records_whose_fields_do_not_cast_safely_are_refused_not_misread() -> None:
    """A signed time of -1 would become 2**64 - 1 in MEMORY_DTYPE and sort last, where the Python paths
    sort it first: such records are refused with a one-line error naming the field."""
    _library()
    recs = np.zeros(2, [("ts", "<i8"), ("addr", "<u8"), ("bytes", "<u8"), ("op", "u1"), ("mk", "u1")])
    recs["ts"], recs["op"], recs["mk"], recs["addr"], recs["bytes"] = [-1, 0], [2, 1], MemoryKind.DEVICE.value, 4096, 64
    with pytest.raises(TypeError, match="field 'ts' of int64 does not cast safely to uint64"):
        ReuseTracker().add(recs)


def test_released_keys_crafted_against_a_fixed_hash_do_not_pile_into_one_run() -> None:
    """The freed keys' table takes a random multiplier (core.c's hash_multiplier): keys k * MIX^-1 all hashed
    to one slot with MIX, and each release walked the run."""
    _library()
    n = 4096
    inverse = pow(MIX, -1, 1 << 64)
    keys = [(k * inverse) % (1 << 64) for k in range(1, n + 1)]
    recs = np.zeros(n, MEMORY_DTYPE)
    # size 0 makes an allocation's key its address: releases of the crafted keys themselves (sizes in the
    # batch are its own: no sizeless mode, releases carry their size 0 only where nothing was allocated)
    recs["ts"], recs["op"], recs["mk"] = 10**15 + np.arange(n), MemoryOp.RELEASE.value, MemoryKind.DEVICE.value
    recs["addr"], recs["bytes"] = keys, 0
    tr = ReuseTracker()
    assert tr._core is not None
    tr.add(recs)
    lib = native.load()[0]
    lib.gfp_reuse_displacement.restype = ctypes.c_uint64
    lib.gfp_reuse_displacement.argtypes = [ctypes.c_void_p]
    assert tr._core.counts()[0] == n
    displaced = int(lib.gfp_reuse_displacement(tr._core.handle))
    assert displaced < 4 * n, displaced
