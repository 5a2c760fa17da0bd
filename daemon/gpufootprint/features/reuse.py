"""Allocation reuse ratio from MEMORY records, for offline replays (``abtest``).

The share of device allocations made at an address and size that an earlier
release freed: a CUDA graph replays fixed addresses, so a step that keeps
reusing the same blocks is one a graph can capture. The live daemon gets this
feature from the sampler's frames; this class computes the same definition from
a recorded trace.
"""

from __future__ import annotations

import numpy as np

from gpufootprint.records import MemoryKind, MemoryOp


class ReuseCounter:
    """Feed MEMORY records in time order (per process); ``ratio(pid)`` answers."""

    def __init__(self) -> None:
        self._freed: dict[int, set[tuple[int, int, int]]] = {}
        self._allocs: dict[int, int] = {}
        self._reused: dict[int, int] = {}
        self._live: dict[tuple[int, int, int], int] = {}  # (pid, dev, addr) -> size: releases may omit it

    def add(self, recs: np.ndarray) -> None:
        sel = recs[recs["mk"] == MemoryKind.DEVICE]
        if len(sel) == 0:
            return
        sel = sel[np.argsort(sel["ts"], kind="stable")]
        for pid, dev, op, addr, size in zip(sel["pid"].tolist(), sel["dev"].tolist(), sel["op"].tolist(),
                                            sel["addr"].tolist(), sel["bytes"].tolist()):
            freed = self._freed.setdefault(pid, set())
            if op == MemoryOp.RELEASE:
                freed.add((dev, addr, self._live.pop((pid, dev, addr), size)))
            elif op == MemoryOp.ALLOCATION:
                self._live[(pid, dev, addr)] = size
                self._allocs[pid] = self._allocs.get(pid, 0) + 1
                if (dev, addr, size) in freed:
                    self._reused[pid] = self._reused.get(pid, 0) + 1

    def ratio(self, pid: int) -> float | None:
        n = self._allocs.get(pid, 0)
        return self._reused.get(pid, 0) / n if n else None
