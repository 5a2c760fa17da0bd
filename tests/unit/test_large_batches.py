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
from gpufootprint.features import frames as frames_mod
from gpufootprint.features import keyset as keyset_mod
from gpufootprint.features.frames import FrameBuilder
from gpufootprint.features.keyset import KeySet
from gpufootprint.footprint import cells
from gpufootprint.footprint import table as table_mod
from gpufootprint.footprint.peaks import FramePeaks
from gpufootprint.footprint.table import DeviceFootprint
from gpufootprint.records import MEMCPY_DTYPE, CopyKind

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
    rng = np.random.default_rng(seed)
    pairs = [(DeviceFootprint(pid=1, dev=0, peaks=FramePeaks(10 * MS, 300 * MS)),
              FrameBuilder(1, 0, FramePeaks(10 * MS, 300 * MS), keep_ns=2_000 * MS, migration_ns=50 * MS,
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
