"""Random record batches and state views shared by the fast-path tests (test_small_batches.py,
test_large_batches.py): each holds a fast path equal to the path it skips on the same inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gpufootprint.features.reuse import ReuseTracker
from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp
from gpufootprint.sampler import burst


def memory_batch(rng: np.random.Generator, t: int, n: int, addrs: int, sizeless: bool) -> np.ndarray:
    """Random MEMORY records: a few addresses and sizes (so keys repeat), mostly device memory,
    sometimes out of time order, sometimes releases without their size, now and then an unknown op."""
    recs = np.zeros(n, MEMORY_DTYPE)
    recs["ts"] = t + np.sort(rng.integers(0, 50_000_000, n))
    if rng.random() < 0.2 and n > 1:
        recs["ts"] = recs["ts"][rng.permutation(n)]
    recs["op"] = rng.choice([MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value, 7], n, p=[0.5, 0.45, 0.05])
    recs["addr"] = rng.integers(0, addrs, n).astype(np.uint64) * np.uint64(4096)  # 0 included
    sizes = np.array([0, 512, 4096, 1 << 20, (1 << 64) - 1], np.uint64)
    recs["bytes"] = rng.choice(sizes, n, p=[0.05, 0.3, 0.3, 0.3, 0.05])
    if sizeless:
        recs["bytes"][(recs["op"] == MemoryOp.RELEASE.value) & (rng.random(n) < 0.5)] = 0
    recs["mk"] = rng.choice([MemoryKind.DEVICE.value, MemoryKind.PINNED.value], n, p=[0.85, 0.15])
    return recs


def reuse_state(tr: ReuseTracker, keys: list[int]) -> tuple[Any, ...]:
    """Counts, events, remembered sizes and freed keys: read from the C core where the tracker has one."""
    if tr._core is not None:
        freed, _, sizeless = tr._core.counts()
        return (tr.allocations, tr.reused, tr.events().tolist(), tr._core.live(), sizeless, freed,
                [tr._core.has_freed(k) for k in keys], tr.ratio)
    return (tr.allocations, tr.reused, tr.events().tolist(), dict(tr._live), tr._sizeless, len(tr._freed),
            [tr._freed.has(k) for k in keys], tr.ratio)


_MS = 1_000_000
BurstStretch = tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray, int, int, burst.Window]


def burst_stretch(rng: np.random.Generator, *, max_frames: int, n_ahead: Callable[[], int], other_max: int,
                  late_frames: tuple[int, ...] = (), calm_max: int = 5) -> BurstStretch:
    """A random stretch of 5 ms burst frames, as ``judge_frames`` and its Python twins take it:
    (cursor, iv, frames, mem_ts, ev_ts, total, i_mem, i_ev, win). A few events lie before the cursor
    (walked already: ``i_mem``, ``i_ev`` of them), ``n_ahead()`` memory events and up to ``other_max``
    others ahead, now and then right at the frames' ends; ``late_frames``: a first event that many frames
    in, drawn among them (none: from the cursor on); levels near and far from the window's baseline,
    windows young and about to reach ``burst_max_ms``."""
    iv = 5 * _MS
    cursor = 10**12 + int(rng.integers(0, 10**6))
    frames = int(rng.integers(1, max_frames))
    grain = int(rng.choice([1, iv // 4]))  # now and then events right at the frames' ends
    ahead_n = n_ahead()
    late = int(rng.choice(late_frames)) * iv if late_frames else 0
    reach = (frames + (5 if late_frames else 2)) * iv
    ahead = np.sort(cursor + rng.integers(late // grain, reach // grain, ahead_n) * grain)
    before = np.sort(cursor - rng.integers(1, 10 * iv, int(rng.integers(0, 4))))
    mem_ts = np.concatenate([before, ahead]).astype(np.int64)
    n_mem, i_mem = len(mem_ts), len(before)
    other = np.sort(cursor + rng.integers(0, (frames + 2) * iv, int(rng.integers(0, other_max)))).astype(np.int64)
    ev_ts = np.sort(np.concatenate([mem_ts, other]), kind="stable")
    i_ev = int(np.searchsorted(ev_ts, cursor, "left"))
    level = int(rng.integers(0, 1 << 32))
    total = level + np.cumsum(rng.choice([1 << 20, -(1 << 20), 64 << 20, -(64 << 20), 4 << 10], n_mem))
    level = int(total[i_mem - 1]) if i_mem else level  # the level at the cursor
    win = burst.Window(start=cursor - int(rng.integers(0, 2000)) * _MS, baseline=int(rng.integers(0, 1 << 32)),
                       calm=int(rng.integers(0, calm_max)), last_volatile_end=cursor - int(rng.integers(0, 200)) * _MS,
                       level=level, range_ewma=float(rng.choice([0.0, 1e6, 1e9])),
                       rate_ewma=float(rng.choice([0.0, 50.0, 1e4])))
    return cursor, iv, frames, mem_ts, ev_ts, total, i_mem, i_ev, win


def as_lists(stretch: BurstStretch) -> tuple[Any, ...]:
    """``walk_frames``'s arguments for a stretch: what lies ahead of the cursor, as lists."""
    cursor, iv, frames, mem_ts, ev_ts, total, i_mem, i_ev, win = stretch
    return (cursor, iv, frames, mem_ts[i_mem:].tolist(), ev_ts[i_ev:].tolist(), total[i_mem:].tolist(),
            i_mem, i_ev, win)
