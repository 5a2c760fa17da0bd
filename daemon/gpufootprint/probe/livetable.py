"""The probe's own live allocation table, sent whole after every (re)connect.

CUPTI delivers records out of timestamp order, and stream-ordered allocators
free and reuse an address quickly, so the table keys each address by the time of
its allocation: a release only removes the allocation it can belong to (one made
before it), and a release seen before its allocation leaves a tombstone that
cancels that allocation when it arrives. Entries built from PyTorch's segment
list after a profiler gap may cover several CUPTI allocations (expandable
segments map in chunks); a release inside such a range shrinks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import numpy as np

from gpufootprint.records import DEVICE_RESIDENT_KINDS, MEMORY_DTYPE, MemoryKind, MemoryOp

_ALLOC: Final = int(MemoryOp.ALLOCATION)
_RELEASE: Final = int(MemoryOp.RELEASE)
_TOMBSTONES_MAX: Final = 4096

# Field positions in a MEMORY_DTYPE row tuple.
TS, ADDR, BYTES = 0, 1, 2
PID, DEV = 7, 8
OP, MK, IS_ASYNC = 12, 13, 14


@dataclass
class LiveTable:
    rows: dict[int, tuple] = field(default_factory=dict)  # addr -> MEMORY row (op = allocation)
    ranges: dict[int, tuple] = field(default_factory=dict)  # synthetic entries (torch segments) by start addr
    tombstones: dict[int, int] = field(default_factory=dict)  # addr -> release ts seen before its allocation
    stale_releases: int = 0
    range_splits: int = 0  # releases that cut a synthetic range: the daemon needs a fresh resync

    def apply(self, recs: np.ndarray) -> None:
        """Apply a batch of MEMORY records, in the order CUPTI delivered them."""
        rows = self.rows
        for row in recs.tolist():
            op, addr, ts = row[OP], row[ADDR], row[TS]
            if op == _ALLOC:
                dead = self.tombstones.get(addr)
                if dead is not None and dead >= ts:
                    del self.tombstones[addr]  # its release already came
                    continue
                old = rows.get(addr)
                if old is None or old[TS] <= ts:
                    rows[addr] = row
            elif op == _RELEASE:
                old = rows.get(addr)
                if old is not None and old[TS] <= ts:
                    del rows[addr]
                elif old is None:
                    if self.ranges and self._cut_range(addr, row[BYTES]):
                        continue
                    if len(self.tombstones) >= _TOMBSTONES_MAX:
                        self.tombstones.pop(next(iter(self.tombstones)))
                    self.tombstones[addr] = ts
                else:
                    self.stale_releases += 1  # belongs to an allocation this one replaced

    def _cut_range(self, addr: int, size: int) -> bool:
        for start, row in self.ranges.items():
            end = start + row[BYTES]
            if start <= addr < end:
                del self.ranges[start]
                head = addr - start
                tail = end - (addr + size)
                if head > 0:
                    self.ranges[start] = _with(row, start, head)
                if tail > 0:
                    self.ranges[addr + size] = _with(row, addr + size, tail)
                if head > 0 or tail > 0:
                    self.range_splits += 1
                return True
        return False

    def set_untracked(self, dev: int, nbytes: int, ts: int, pid: int) -> tuple | None:
        """Replace the synthetic UNTRACKED entry of ``dev``; returns the old row (for a release)."""
        addr = untracked_address(dev)
        old = self.rows.pop(addr, None)
        if nbytes > 0:
            self.rows[addr] = (ts, addr, nbytes, 0, 0, 0, 0, pid, dev, 0, 0, 0, _ALLOC, int(MemoryKind.UNTRACKED), 0, 0)
        return old

    def resident_bytes(self, dev: int, *, exclude_untracked: bool = True) -> int:
        total = 0
        for row in self._all():
            if row[DEV] == dev and row[MK] in DEVICE_RESIDENT_KINDS:
                if exclude_untracked and row[MK] == MemoryKind.UNTRACKED:
                    continue
                total += row[BYTES]
        return total

    def live_by_kind(self, dev: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self._all():
            if row[DEV] == dev:
                name = MemoryKind(row[MK]).name.lower() if row[MK] in MemoryKind._value2member_map_ else str(row[MK])
                out[name] = out.get(name, 0) + row[BYTES]
        return {k: v for k, v in out.items() if v}

    def device_bytes_outside(self, dev: int, segments: list) -> int:  # type: ignore[type-arg]
        """Non-async DEVICE bytes of ``dev`` not inside any (dev, addr, size) segment."""
        spans = [(int(a), int(a) + int(s)) for d, a, s in segments if int(d) == dev]
        total = 0
        for row in self._all():
            if row[DEV] == dev and row[MK] == MemoryKind.DEVICE and not row[IS_ASYNC]:
                if not any(lo <= row[ADDR] < hi for lo, hi in spans):
                    total += row[BYTES]
        return total

    def _all(self) -> list[tuple]:
        return [*self.rows.values(), *self.ranges.values()]

    def to_array(self, ts: int) -> np.ndarray:
        """The whole table as allocation records (for RESYNC)."""
        rows = self._all()
        arr = np.zeros(len(rows), dtype=MEMORY_DTYPE)
        for i, row in enumerate(rows):
            arr[i] = row
        return arr

    # --- profiler gap --------------------------------------------------------------

    def split_torch_owned(self, segments: list[tuple[int, int, int]]) -> None:
        """Drop the entries PyTorch's allocator owns (inside ``segments`` = (dev, addr, size))."""
        spans = sorted((a, a + s) for _, a, s in segments)
        starts = [a for a, _ in spans]
        import bisect

        def inside(addr: int) -> bool:
            i = bisect.bisect_right(starts, addr) - 1
            return i >= 0 and addr < spans[i][1]

        self.rows = {a: r for a, r in self.rows.items()
                     if not (r[MK] == MemoryKind.DEVICE and not r[IS_ASYNC] and inside(a))}
        self.ranges.clear()

    def add_torch_segments(self, segments: list[tuple[int, int, int]], ts: int, pid: int) -> None:
        for dev, addr, size in segments:
            row = (ts, addr, size, 0, 0, 0, 0, pid, dev, 0, 0, 0, _ALLOC, int(MemoryKind.DEVICE), 0, 0)
            if addr in self.rows:
                self.rows[addr] = row  # a CUPTI record of it came in after re-arming
            else:
                self.ranges[addr] = row
        self.tombstones.clear()


def untracked_address(dev: int) -> int:
    """A fixed address no allocation can have (the top of the 64-bit space)."""
    return 0xFFFF_FFFF_FFFF_0000 | (dev & 0xFFFF)


def _with(row: tuple, addr: int, size: int) -> tuple:
    r = list(row)
    r[ADDR], r[BYTES] = addr, size
    return tuple(r)
