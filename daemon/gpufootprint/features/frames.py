"""Feature frames per (pid, device), from exact event timestamps.

Every record is counted in the frame its own timestamp falls in (10 ms frames,
the footprint's ``frame_ms``), never in the poll that happened to see it. The
per-frame peak is not recomputed here: a builder reads the footprint's own
``FramePeaks`` (same frames), and the level changes the footprint applied reach
it through ``on_levels``, handed down by the pipeline, so the peak logic exists
once.

Work is per batch with numpy (``reduceat`` over runs of one frame), except the
allocation-reuse ratio (``features.reuse``), which needs a set lookup per allocation.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Final

import numpy as np

from gpufootprint.changes import counted
from gpufootprint.features.reuse import ReuseTracker
from gpufootprint.footprint.cells import cell_sums, run_ends, run_starts
from gpufootprint.footprint.peaks import FramePeaks
from gpufootprint.records import COPY_KIND_NAMES, CopyKind, MemoryOp, um_counter_values


class UmCounterKind(enum.IntEnum):
    """CUPTI_ActivityUnifiedMemoryCounterKind."""

    UNKNOWN = 0
    BYTES_TRANSFER_HTOD = 1
    BYTES_TRANSFER_DTOH = 2
    CPU_PAGE_FAULT_COUNT = 3
    GPU_PAGE_FAULT = 4
    THRASHING = 5
    THROTTLING = 6
    REMOTE_MAP = 7
    BYTES_TRANSFER_DTOD = 8


UM_TRANSFER_DIRECTIONS: Final[dict[int, str]] = {
    UmCounterKind.BYTES_TRANSFER_HTOD: "htod",
    UmCounterKind.BYTES_TRANSFER_DTOH: "dtoh",
    UmCounterKind.BYTES_TRANSFER_DTOD: "dtod",
}
UM_FAULT_SIDES: Final[dict[int, str]] = {
    UmCounterKind.CPU_PAGE_FAULT_COUNT: "cpu",
    UmCounterKind.GPU_PAGE_FAULT: "gpu",
}
#: Host<->device copies count as migrations in the migration frequency.
HOST_DEVICE_COPIES: Final[frozenset[int]] = frozenset({CopyKind.HTOD, CopyKind.DTOH})


@dataclass(frozen=True, slots=True)
class FrameRow:
    """One frame that saw at least one record. ``peak_bytes``: GPU-resident bytes."""

    start_ns: int
    peak_bytes: int
    allocations: int
    allocated_bytes: int
    releases: int
    released_bytes: int
    memcpy_bytes: dict[str, int]  # by direction
    memset_bytes: int


@dataclass(frozen=True, slots=True)
class MigrationWindow:
    start_ns: int
    width_ns: int
    um_transfers: dict[str, int]  # records, by direction
    um_bytes: dict[str, int]
    page_faults: dict[str, int]  # fault counts, by side
    copies: int  # host<->device copy records
    copy_bytes: int
    pcie_tx_bytes_per_second: float | None = None  # NVML sample of the same window (align_pcie)
    pcie_rx_bytes_per_second: float | None = None

    @property
    def events(self) -> int:
        return sum(self.um_transfers.values()) + sum(self.page_faults.values()) + self.copies

    @property
    def frequency_hz(self) -> float:
        return self.events / (self.width_ns / 1e9)


#: Batches of at most this many records are counted in Python, record by record: below it the numpy
#: path's calls of fixed cost (a dozen per batch) outweigh a loop.
SMALL_BATCH = 128
#: A larger batch is summed per (kind, frame) cell with one bincount (``footprint.cells``) while its
#: cells number at most this many per record (plus a few): a batch spread thin over time takes the
#: per-kind runs, whose cost follows the records, not the time they span.
_CELLS_PER_RECORD = 4

_ALLOCATION, _RELEASE = MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value

# Column indexes of the per-frame counters.
_A_N, _A_B, _R_N, _R_B, _SET_B = range(5)
# Migration-window columns: transfers htod/dtoh/dtod, bytes htod/dtoh/dtod, faults cpu/gpu, copies, copy bytes.
_MIG_COLS = 10
_MIG_TRANSFER = {UmCounterKind.BYTES_TRANSFER_HTOD: 0, UmCounterKind.BYTES_TRANSFER_DTOH: 1,
                 UmCounterKind.BYTES_TRANSFER_DTOD: 2}
_MIG_FAULT = {UmCounterKind.CPU_PAGE_FAULT_COUNT: 6, UmCounterKind.GPU_PAGE_FAULT: 7}


def _runs(idx: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Start positions of runs of equal values in sorted ``idx``, and the values."""
    starts = run_starts(idx)
    return starts, idx[starts].tolist()


class FrameBuilder:
    """Frames and feature counters of one (pid, device). Feed it batches in time order."""

    def __init__(self, pid: int, dev: int, peaks: FramePeaks, *, keep_ns: int, migration_ns: int,
                 reuse_capacity: int) -> None:
        self.pid = pid
        self.dev = dev
        self.peaks = peaks
        self.frame_ns = peaks.frame_ns
        self.migration_ns = migration_ns
        self._keep_frames = max(1, keep_ns // self.frame_ns)
        self._keep_windows = max(1, keep_ns // migration_ns)
        self._full_keep = (self._keep_frames, self._keep_windows)
        self._frames: dict[int, list[int]] = {}
        self._copies: dict[int, Counter[int]] = {}
        self._end_level: dict[int, int] = {}  # frame -> GPU-resident level after its last memory event
        self._windows: dict[int, list[int]] = {}
        self._newest_frame = -1
        self._newest_window = -1
        self.reuse = ReuseTracker(reuse_capacity)  # device allocations at a freed (address, size)
        self.page_migrations: Counter[str] = Counter()
        self.page_faults: Counter[str] = Counter()
        self.torch_allocated: int | None = None
        self.torch_reserved: int | None = None
        # Every call of a method that changes what the features read (``changes.counted``): the hub keeps a device's
        # features while this count, the sampler's steps, the watermark and the pool figures stay as they were.
        self.changes = 0

    @counted
    def share_history(self, part: float) -> None:
        """Keep ``part`` (0 < part <= 1) of the configured history (frames, migration windows, reuse):
        the hub's node-wide budget divided among the tables (``features.history_tables``)."""
        frames, windows = self._full_keep
        self._keep_frames = max(1, int(frames * part))
        self._keep_windows = max(1, int(windows * part))
        self.reuse.share(part)
        self._prune()

    # --- input ------------------------------------------------------------------

    @counted
    def on_levels(self, ts: np.ndarray, deltas: np.ndarray, level_after: int) -> None:
        """GPU-resident level changes just applied to the footprint (time order)."""
        runs = self.peaks.runs
        if runs is not None and runs.deltas is deltas and runs.level_after == level_after and runs.of(ts):
            # The footprint's peaks just cut these changes into the same frames: their end levels.
            for fid, lvl in zip(runs.frame_ids, runs.end_levels):
                self._end_level[fid] = lvl
            return
        if len(ts) <= SMALL_BATCH:
            frame_ns, end_level = self.frame_ns, self._end_level
            d_list = deltas.tolist()
            level = level_after - sum(d_list)
            for t, d in zip(ts.tolist(), d_list):  # the last event of each frame's run sets its end level
                level += d
                end_level[t // frame_ns] = level
            return
        idx = ts.astype(np.int64) // self.frame_ns
        levels = level_after - int(deltas.sum()) + deltas.cumsum(dtype=np.int64)
        ends = run_ends(idx)
        for fid, lvl in zip(idx[ends].tolist(), levels[ends].tolist()):
            self._end_level[fid] = lvl

    @counted
    def on_memory(self, recs: np.ndarray) -> None:
        runs = self.peaks.take_runs()  # the last reader of the footprint's runs of this batch
        if len(recs) <= SMALL_BATCH:
            self._on_memory_small(recs)
            self.reuse.add(recs)
            self._prune()
            return
        ts = recs["ts"]
        if runs is not None and runs.starts is not None and runs.of(ts):  # the peaks cut these times already
            starts, fids = runs.starts, runs.frame_ids
        else:
            starts, fids = _runs(ts.astype(np.int64) // self.frame_ns)
        op = recs["op"]
        size = recs["bytes"].astype(np.int64)
        is_alloc = op == _ALLOCATION  # a plain int: numpy compares with an IntEnum member several times slower
        is_rel = op == _RELEASE
        cols = (np.add.reduceat(is_alloc.astype(np.int64), starts).tolist(),
                np.add.reduceat(np.where(is_alloc, size, 0), starts).tolist(),
                np.add.reduceat(is_rel.astype(np.int64), starts).tolist(),
                np.add.reduceat(np.where(is_rel, size, 0), starts).tolist())
        for i, fid in enumerate(fids):
            row = self._row(fid)
            row[_A_N] += cols[0][i]
            row[_A_B] += cols[1][i]
            row[_R_N] += cols[2][i]
            row[_R_B] += cols[3][i]
        self.reuse.add(recs)
        self._prune()

    def _on_memory_small(self, recs: np.ndarray) -> None:
        """``on_memory``'s counters, record by record (each record counts in its own frame's row)."""
        frame_ns = self.frame_ns
        alloc, release = MemoryOp.ALLOCATION.value, MemoryOp.RELEASE.value
        fid, row = -1, None
        for t, op, size in zip(recs["ts"].tolist(), recs["op"].tolist(), recs["bytes"].tolist()):
            f = t // frame_ns
            if f != fid or row is None:
                fid, row = f, self._row(f)
            if op == alloc:
                row[_A_N] += 1
                row[_A_B] += size
            elif op == release:
                row[_R_N] += 1
                row[_R_B] += size

    @counted
    def on_memcpy(self, recs: np.ndarray) -> None:
        if len(recs) <= SMALL_BATCH:
            self._on_memcpy_small(recs)
            self._prune()
            return
        start = recs["start"].astype(np.int64)
        ck = recs["ck"]
        size = recs["bytes"].astype(np.int64)
        if self._on_memcpy_cells(start, ck, size):
            self._prune()
            return
        for kind in np.unique(ck).tolist():
            sel = ck == kind
            starts, fids = _runs(start[sel] // self.frame_ns)
            sums = np.add.reduceat(size[sel], starts).tolist()
            for fid, b in zip(fids, sums):
                self._row(fid)
                self._copies.setdefault(fid, Counter())[kind] += b
        hd = np.isin(ck, list(HOST_DEVICE_COPIES))
        if hd.any():
            starts, wids = _runs(start[hd] // self.migration_ns)
            n = np.add.reduceat(np.ones(int(hd.sum()), np.int64), starts).tolist()
            b = np.add.reduceat(size[hd], starts).tolist()
            for i, wid in enumerate(wids):
                w = self._window(wid)
                w[8] += n[i]
                w[9] += b[i]
        self._prune()

    def _on_memcpy_cells(self, start: np.ndarray, ck: np.ndarray, size: np.ndarray) -> bool:
        """``on_memcpy``'s sums with one bincount per column over (copy kind, frame) cells and over
        migration windows (``footprint.cells``), added in the per-kind path's order; False (nothing
        added) where that does not apply: a batch spread thin over time, or sums past float64's exact range."""
        n = len(start)
        by_frame = cell_sums(ck, start // self.frame_ns, [size], _CELLS_PER_RECORD * n + 64)
        if by_frame is None:
            return False
        per_window = self.migration_ns // self.frame_ns if self.migration_ns % self.frame_ns == 0 else 0
        if per_window:
            # Each frame lies in one migration window: the windows' sums are their frames'.
            windows: dict[int, list[int]] = {}
            for kind, fid, count, b in zip(by_frame[0], by_frame[1], by_frame[2], by_frame[3][0]):
                if kind in HOST_DEVICE_COPIES:
                    w = windows.setdefault(fid // per_window, [0, 0])
                    w[0] += count
                    w[1] += b
            wids = sorted(windows)  # in window order, as the runs over the records would add them
            by_window = ([1] * len(wids), wids, [windows[w][0] for w in wids], [[windows[w][1] for w in wids]])
        else:
            hd = (ck == CopyKind.HTOD) | (ck == CopyKind.DTOH)  # HOST_DEVICE_COPIES
            found = cell_sums(hd.view(np.uint8), start // self.migration_ns, [size], 2 * (_CELLS_PER_RECORD * n + 64))
            if found is None:
                return False
            by_window = found
        copies = self._copies
        for kind, fid, b in zip(by_frame[0], by_frame[1], by_frame[3][0]):
            self._row(fid)
            c = copies.get(fid)
            if c is None:
                c = copies[fid] = Counter()
            c[kind] += b
        for host, wid, count, b in zip(by_window[0], by_window[1], by_window[2], by_window[3][0]):
            if host:
                w = self._window(wid)
                w[8] += count
                w[9] += b
        return True

    def _on_memcpy_small(self, recs: np.ndarray) -> None:
        """``on_memcpy`` record by record: the sums gathered first, then added in the batch path's order
        (copy kinds ascending, each kind's frames as they come; windows as they come)."""
        frame_ns, migration_ns = self.frame_ns, self.migration_ns
        by_kind: dict[int, dict[int, int]] = {}
        windows: dict[int, list[int]] = {}
        for start, kind, size in zip(recs["start"].tolist(), recs["ck"].tolist(), recs["bytes"].tolist()):
            frames = by_kind.setdefault(kind, {})
            fid = start // frame_ns
            frames[fid] = frames.get(fid, 0) + size
            if kind in HOST_DEVICE_COPIES:
                w = windows.setdefault(start // migration_ns, [0, 0])
                w[0] += 1
                w[1] += size
        for kind in sorted(by_kind):
            for fid, b in by_kind[kind].items():
                self._row(fid)
                self._copies.setdefault(fid, Counter())[kind] += b
        for wid, (n, b) in windows.items():
            w = self._window(wid)
            w[8] += n
            w[9] += b

    @counted
    def on_memset(self, recs: np.ndarray) -> None:
        if len(recs) <= SMALL_BATCH:
            frame_ns = self.frame_ns
            sums: dict[int, int] = {}
            for start, size in zip(recs["start"].tolist(), recs["bytes"].tolist()):
                sums[start // frame_ns] = sums.get(start // frame_ns, 0) + size
            for fid, b in sums.items():
                self._row(fid)[_SET_B] += b
            self._prune()
            return
        starts, fids = _runs(recs["start"].astype(np.int64) // self.frame_ns)
        sums = np.add.reduceat(recs["bytes"].astype(np.int64), starts).tolist()
        for fid, b in zip(fids, sums):
            self._row(fid)[_SET_B] += b
        self._prune()

    @counted
    def on_unified(self, recs: np.ndarray) -> None:
        start = recs["start"].astype(np.int64)
        ck = recs["ck"]
        value = um_counter_values(ck, recs["value"])
        for kind in np.unique(ck).tolist():
            sel = ck == kind
            if kind in _MIG_TRANSFER:
                col = _MIG_TRANSFER[kind]
                self.page_migrations[UM_TRANSFER_DIRECTIONS[kind]] += int(sel.sum())
                starts, wids = _runs(start[sel] // self.migration_ns)
                n = np.add.reduceat(np.ones(int(sel.sum()), np.int64), starts).tolist()
                b = np.add.reduceat(value[sel], starts).tolist()
                for i, wid in enumerate(wids):
                    w = self._window(wid)
                    w[col] += n[i]
                    w[col + 3] += b[i]
            elif kind in _MIG_FAULT:
                col = _MIG_FAULT[kind]
                self.page_faults[UM_FAULT_SIDES[kind]] += int(value[sel].sum())
                starts, wids = _runs(start[sel] // self.migration_ns)
                v = np.add.reduceat(value[sel], starts).tolist()
                for i, wid in enumerate(wids):
                    self._window(wid)[col] += v[i]
        self._prune()

    @counted
    def on_torch(self, allocated: int | None, reserved: int | None) -> None:
        self.torch_allocated, self.torch_reserved = allocated, reserved

    def _row(self, fid: int) -> list[int]:
        row = self._frames.get(fid)
        if row is None:
            row = self._frames[fid] = [0, 0, 0, 0, 0]
            self._newest_frame = max(self._newest_frame, fid)
        return row

    def _window(self, wid: int) -> list[int]:
        w = self._windows.get(wid)
        if w is None:
            w = self._windows[wid] = [0] * _MIG_COLS
            self._newest_window = max(self._newest_window, wid)
        return w

    def _prune(self) -> None:
        # Amortised: prune only when a quarter more than the history has piled up.
        if len(self._frames) > self._keep_frames * 5 // 4 + 8:
            horizon = self._newest_frame - self._keep_frames
            for table in (self._frames, self._copies, self._end_level):
                for fid in [f for f in table if f < horizon]:
                    del table[fid]
        if len(self._windows) > self._keep_windows * 5 // 4 + 8:
            horizon = self._newest_window - self._keep_windows
            for wid in [w for w in self._windows if w < horizon]:
                del self._windows[wid]

    # --- output -------------------------------------------------------------------

    def frames(self, since_ns: int = 0) -> list[FrameRow]:
        """Every kept frame that saw a record, oldest first."""
        peaks = {start // self.frame_ns: p for start, p in self.peaks.frames()}
        ends = self._end_level
        level_ids = sorted(ends)
        out: list[FrameRow] = []
        pos = 0
        held: int | None = None
        oldest = min(self._frames) if self._frames else 0  # older peaks outlive our pruned counters
        for fid in sorted(f for f in set(self._frames) | set(peaks) if f >= oldest):
            while pos < len(level_ids) and level_ids[pos] < fid:
                held = ends[level_ids[pos]]
                pos += 1
            if fid * self.frame_ns < since_ns:
                continue
            row = self._frames.get(fid, [0, 0, 0, 0, 0])
            peak = peaks.get(fid)
            if peak is None:
                peak = held if held is not None else 0
            copies = self._copies.get(fid, Counter())
            out.append(FrameRow(
                start_ns=fid * self.frame_ns, peak_bytes=peak, allocations=row[_A_N],
                allocated_bytes=row[_A_B], releases=row[_R_N], released_bytes=row[_R_B],
                memcpy_bytes={COPY_KIND_NAMES.get(k, str(k)): b for k, b in sorted(copies.items())},
                memset_bytes=row[_SET_B]))
        return out

    def migration_windows(self) -> list[MigrationWindow]:
        return [self._migration_window(wid) for wid in sorted(self._windows)]

    def recent_migration_windows(self, as_of_ns: int, n: int = 20) -> list[MigrationWindow]:
        """The windows with activity among the last ``n`` closed by ``as_of_ns`` (default: 1 s).

        Built for those ``n`` only: every snapshot asks, and the history holds up to 258 windows a
        device (``features.keep_seconds`` 10 s of 50 ms, a quarter more before it is pruned)."""
        last_closed = as_of_ns // self.migration_ns - 1
        return [self._migration_window(wid) for wid in range(last_closed - n + 1, last_closed + 1)
                if wid in self._windows]

    def _migration_window(self, wid: int) -> MigrationWindow:
        w = self._windows[wid]
        return MigrationWindow(
            start_ns=wid * self.migration_ns, width_ns=self.migration_ns,
            um_transfers={"htod": w[0], "dtoh": w[1], "dtod": w[2]},
            um_bytes={"htod": w[3], "dtoh": w[4], "dtod": w[5]},
            page_faults={"cpu": w[6], "gpu": w[7]}, copies=w[8], copy_bytes=w[9])

    def migration_rate_hz(self, as_of_ns: int) -> float | None:
        """Migration frequency of the last window closed by ``as_of_ns`` (None before any)."""
        if not self._windows:
            return None
        last_closed = as_of_ns // self.migration_ns - 1
        w = self._windows.get(last_closed)
        if w is None:
            return 0.0
        return (w[0] + w[1] + w[2] + w[6] + w[7] + w[8]) / (self.migration_ns / 1e9)

    @property
    def reuse_ratio(self) -> float | None:
        return self.reuse.ratio

    @property
    def allocator_slack_bytes(self) -> int | None:
        if self.torch_reserved is None or self.torch_allocated is None:
            return None
        return self.torch_reserved - self.torch_allocated


def align_pcie(windows: list[MigrationWindow],
               samples: list[tuple[int, float, float]]) -> list[MigrationWindow]:
    """Attach to each window the NVML PCIe sample (ts ns, tx B/s, rx B/s) taken inside it.

    Several samples in one window are averaged; a window without a sample keeps None.
    """
    if not samples:
        return list(windows)
    ts = np.array([s[0] for s in samples], dtype=np.int64)
    order = np.argsort(ts, kind="stable")
    ts = ts[order]
    tx = np.array([s[1] for s in samples], dtype=np.float64)[order]
    rx = np.array([s[2] for s in samples], dtype=np.float64)[order]
    out = []
    for w in windows:
        lo = int(np.searchsorted(ts, w.start_ns, "left"))
        hi = int(np.searchsorted(ts, w.start_ns + w.width_ns, "left"))
        if hi > lo:
            out.append(MigrationWindow(w.start_ns, w.width_ns, w.um_transfers, w.um_bytes, w.page_faults,
                                       w.copies, w.copy_bytes, float(tx[lo:hi].mean()), float(rx[lo:hi].mean())))
        else:
            out.append(w)
    return out
