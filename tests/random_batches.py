"""Random record batches and state views shared by the fast-path tests (test_small_batches.py,
test_large_batches.py): each holds a fast path equal to the path it skips on the same inputs."""

from __future__ import annotations

from typing import Any

import numpy as np
from gpufootprint.features.reuse import ReuseTracker
from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp


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
    return (tr.allocations, tr.reused, tr.events().tolist(), dict(tr._live), tr._sizeless, len(tr._freed),
            [tr._freed.has(k) for k in keys], tr.ratio)
