"""Allocation reuse ratio from MEMORY records, for offline replays (``abtest``).

The share of device allocations made at an address and size that an earlier
release freed: a CUDA graph replays fixed addresses, so a step that keeps
reusing the same blocks is one a graph can capture. Counted over the steady
part of the run (allocations from ``since`` on). A process that made *no*
device allocation then, after having made some before (a warmed-up caching
allocator serves every step from its own segments), has a fully static
footprint: 1.0. No memory records at all: unknown (None).

The live daemon gets this feature from the sampler's frames; this class
computes it from a recorded trace.
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
        self._times: dict[int, list[tuple[int, bool]]] = {}  # pid -> (ts, reused) per allocation

    def add(self, recs: np.ndarray) -> None:
        sel = recs[recs["mk"] == MemoryKind.DEVICE]
        if len(sel) == 0:
            return
        sel = sel[np.argsort(sel["ts"], kind="stable")]
        for ts, pid, dev, op, addr, size in zip(sel["ts"].tolist(), sel["pid"].tolist(), sel["dev"].tolist(),
                                                sel["op"].tolist(), sel["addr"].tolist(), sel["bytes"].tolist()):
            freed = self._freed.setdefault(pid, set())
            if op == MemoryOp.RELEASE:
                freed.add((dev, addr, self._live.pop((pid, dev, addr), size)))
            elif op == MemoryOp.ALLOCATION:
                self._live[(pid, dev, addr)] = size
                self._allocs[pid] = self._allocs.get(pid, 0) + 1
                reused = (dev, addr, size) in freed
                if reused:
                    self._reused[pid] = self._reused.get(pid, 0) + 1
                self._times.setdefault(pid, []).append((ts, reused))

    def ratio(self, pid: int, since: int | None = None) -> float | None:
        """Reuse over allocations at or after ``since`` (ns; None: all of them)."""
        n = self._allocs.get(pid, 0)
        if not n:
            return None
        if since is None:
            return self._reused.get(pid, 0) / n
        recent = [r for t, r in self._times.get(pid, []) if t >= since]
        return sum(recent) / len(recent) if recent else 1.0
