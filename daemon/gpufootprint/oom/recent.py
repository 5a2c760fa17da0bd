"""Each process's records of the last N seconds, as the pipeline applied them.

Fed by the feature hub's tap (records of one kind, one device, in time order, after
the reorder buffer), so what is kept is exactly what built the footprint. Chunks are
kept whole and dropped whole: by age (older than ``seconds`` behind the newest record
of the process) and by size (``max_bytes`` per process, oldest first; past ``max_total_bytes``
for all processes together, the oldest chunk of the process holding the most). ``covered_from``
says from when on nothing was dropped, so a capture never claims a record it lost.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from gpufootprint.records import DTYPES, TIME_FIELD, RecordKind, copy_records, holds_only_itself


@dataclass
class _Recent:
    chunks: deque[tuple[int, int, RecordKind, np.ndarray]] = field(default_factory=deque)  # (lo, hi, kind, recs)
    nbytes: int = 0
    newest: int = 0
    covered_from: int = 0  # every record with a time above this is kept (0: nothing dropped yet)
    order: int = 0  # when the process was first kept: of those holding the most, the first kept loses first


class RecentRecords:
    def __init__(self, seconds: float, max_bytes: int, max_total_bytes: int | None = None) -> None:
        self.window_ns = int(seconds * 1e9)
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes if max_total_bytes is not None else max_bytes * 4
        self.total_bytes = 0
        self._procs: dict[int, _Recent] = {}
        self.dropped_for_size = 0  # records dropped by the size bound before their time was up
        # (-nbytes, order, pid) of every process, pushed at each change of its bytes, stale entries skipped
        # when met: who holds the most without a scan of every process at every chunk past the total bound
        # (a full node's 64 or 256 processes are past it at every chunk once a minute of records is kept).
        self._most: list[tuple[int, int, int]] = []
        self._order = 0

    def add(self, pid: int, kind: RecordKind, recs: np.ndarray) -> None:
        if len(recs) == 0:
            return
        r = self._procs.get(pid)
        if r is None:
            self._order += 1
            r = self._procs[pid] = _Recent(order=self._order)
        times = recs[TIME_FIELD[kind]]
        lo, hi = int(times.min()), int(times.max())
        # A view into a large decoded frame would keep the whole frame alive (and could see its bytes
        # change): own the rows. A joined or sorted chunk is already a whole array of its own: kept as it is.
        own = recs if holds_only_itself(recs) else copy_records(recs)
        r.chunks.append((lo, hi, kind, own))
        r.nbytes += own.nbytes
        self.total_bytes += own.nbytes
        r.newest = max(r.newest, hi)
        cut = r.newest - self.window_ns
        while r.chunks and (r.chunks[0][1] < cut or r.nbytes > self.max_bytes):
            self._drop_oldest(r, cut)
        self._held(pid, r)
        while self.total_bytes > self.max_total_bytes:
            most, biggest = self._holding_most()
            if not biggest.chunks:
                break
            self._drop_oldest(biggest, biggest.newest - self.window_ns)
            self._held(most, biggest)

    def _held(self, pid: int, r: _Recent) -> None:
        """``r`` (``pid``'s) holds ``r.nbytes`` now."""
        heapq.heappush(self._most, (-r.nbytes, r.order, pid))
        if len(self._most) > 2 * len(self._procs) + 64:  # mostly stale: rebuilt from the processes kept
            self._most = [(-p.nbytes, p.order, q) for q, p in self._procs.items()]
            heapq.heapify(self._most)

    def _holding_most(self) -> tuple[int, _Recent]:
        """The process holding the most bytes; of several, the one kept first (as ``max`` over the
        processes in the order they were first kept picks)."""
        most = self._most
        while True:
            neg, order, pid = most[0]
            r = self._procs.get(pid)
            if r is not None and r.order == order and r.nbytes == -neg:
                return pid, r
            heapq.heappop(most)

    def _drop_oldest(self, r: _Recent, cut: int) -> None:
        _lo, old_hi, _kind, old = r.chunks.popleft()
        if old_hi >= cut:
            self.dropped_for_size += len(old)
        r.nbytes -= old.nbytes
        self.total_bytes -= old.nbytes
        r.covered_from = max(r.covered_from, old_hi)

    def covered_from(self, pid: int) -> int:
        r = self._procs.get(pid)
        return r.covered_from if r is not None else 0

    def window(self, pid: int, after_ns: int, until_ns: int | None = None) -> dict[RecordKind, np.ndarray]:
        """Records of ``pid`` with time in (after_ns, until_ns], per kind, in time order."""
        r = self._procs.get(pid)
        out: dict[RecordKind, list[np.ndarray]] = {}
        if r is not None:
            for lo, hi, kind, recs in r.chunks:
                if hi <= after_ns or (until_ns is not None and lo > until_ns):
                    continue
                t = recs[TIME_FIELD[kind]]
                keep = t > np.uint64(after_ns)
                if until_ns is not None:
                    keep &= t <= np.uint64(until_ns)
                out.setdefault(kind, []).append(recs[keep])
        joined: dict[RecordKind, np.ndarray] = {}
        for kind, parts in out.items():
            arr = np.concatenate(parts) if parts else np.zeros(0, DTYPES[kind])
            order = np.argsort(arr[TIME_FIELD[kind]], kind="stable")
            joined[kind] = arr[order]
        return joined

    def nbytes(self, pid: int) -> int:
        r = self._procs.get(pid)
        return r.nbytes if r is not None else 0

    def forget(self, pid: int) -> None:
        r = self._procs.pop(pid, None)
        if r is not None:
            self.total_bytes -= r.nbytes

    def pids(self) -> list[int]:
        return list(self._procs)
