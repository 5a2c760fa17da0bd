"""Exact peaks from event timestamps, kept per fixed-width frame.

Live bytes only change at allocation and release records, so the highest value
over any interval is the highest level reached at one of those events or the
level already held when the interval began. ``FramePeaks`` keeps, for every
frame (10 ms by default) that saw an event, the highest level reached in it
(the level held on entering the frame included), and answers "peak over the
trailing window" as the max over the frames in it and the current level. A
spike of any duration is never missed; only the window's boundary is rounded
to a frame.

Every change it applies comes back as ``LevelChanges``: the footprint returns
them to the pipeline, which hands them on to the feature frames and the sampler,
so nothing downstream has to watch the tracker.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import NamedTuple

import numpy as np

from gpufootprint.footprint.cells import run_starts

#: Batches of at most this many events are walked in Python (``_frame_peaks_small``): below it the
#: numpy path's dozen calls of fixed cost (cumsum, diff, reduceat, ...) outweigh a loop.
SMALL_BATCH = 128


class LevelChanges(NamedTuple):
    """GPU-resident level changes just applied, in time order, and the level after the last."""

    ts: np.ndarray  # event times (ns)
    deltas: np.ndarray  # signed bytes, one per event (0 for an event that moved no resident byte)
    level_after: int


class FrameRuns(NamedTuple):
    """How the last large batch fell into frames: the feature frames (same frames) read it instead of
    cutting the same times into the same runs again."""

    ts: np.ndarray  # the event times they were cut from
    address: int  # where those times lie in memory (another view of them is the same times)
    deltas: np.ndarray
    starts: np.ndarray | None  # position of each run's first event (None: a small batch, walked in Python)
    frame_ids: list[int]  # each run's frame
    end_levels: list[int]  # the level after each run's last event
    level_after: int

    def of(self, ts: np.ndarray) -> bool:
        """Whether ``ts`` are these times: this very array, or a view of the same memory and layout."""
        return ts is self.ts or (len(ts) == len(self.ts) and ts.strides == self.ts.strides
                                 and ts.dtype == self.ts.dtype and _address(ts) == self.address)


def _address(a: np.ndarray) -> int:
    address: int = a.__array_interface__["data"][0]
    return address


class FramePeaks:
    def __init__(self, frame_ns: int, keep_ns: int) -> None:
        self.frame_ns = frame_ns
        # The runs of the last batch taken with numpy, kept (with a reference to its times, so no other
        # array can take their place in memory) until the feature frames took them (``take_runs``) or
        # the next batch came.
        self.runs: FrameRuns | None = None
        self._keep_frames = max(1, -(-keep_ns // frame_ns))
        self._frames: deque[tuple[int, int]] = deque()  # (frame index, peak), closed frames
        # The closed frames whose peak is above every later closed frame's, oldest first (so their peaks
        # fall): the highest peak from any frame on to the newest is the first of them at or after it.
        # A 60 s window holds up to 6,000 frames a device, walked at every snapshot otherwise (64 processes
        # at ten snapshots a second: most of a core). Rebuilt when a late record changed an older frame.
        self._falling: deque[tuple[int, int]] = deque()
        self._falling_stale = False
        self._open_idx = -1
        self._open_peak = 0
        self.level = 0  # bytes held after the last applied event
        self.late_frames = 0  # events merged into a frame older than the open one

    def add(self, ts: np.ndarray, deltas: np.ndarray) -> LevelChanges:
        """Apply events in time order: ``ts`` sorted, ``deltas`` signed bytes."""
        if len(ts) == 0:
            return LevelChanges(ts, deltas, self.level)
        self.runs = None
        if len(ts) <= SMALL_BATCH:
            frame_ids, peaks, ends, last = _frame_peaks_small(ts.tolist(), deltas.tolist(), self.level, self.frame_ns)
            # Its runs' end levels too: the feature frames read them instead of walking the batch again. Known
            # by these very arrays only (no address: the frames' own view of a record batch's times is not
            # read against a small batch's runs).
            self.runs = FrameRuns(ts, -1, deltas, None, frame_ids, ends, last)
        else:
            levels = self.level + deltas.cumsum(dtype=np.int64)
            idx = ts.astype(np.int64) // self.frame_ns
            starts = run_starts(idx)
            seg_max = np.maximum.reduceat(levels, starts)
            entering = np.empty_like(seg_max)
            entering[0] = self.level
            entering[1:] = levels[starts[1:] - 1]
            peaks = np.maximum(seg_max, entering).tolist()
            frame_ids = idx[starts].tolist()
            last = int(levels[-1])
            ends = entering[1:].tolist()  # the level entering a run is the level after the one before it
            ends.append(last)
            self.runs = FrameRuns(ts, _address(ts), deltas, starts, frame_ids, ends, last)
        for fid, peak in zip(frame_ids, peaks):
            if fid == self._open_idx:
                self._open_peak = max(self._open_peak, peak)
            elif fid > self._open_idx:
                self._close_open()
                self._open_idx, self._open_peak = fid, peak
            else:
                self._merge_closed(fid, peak)
        self.level = last
        self._prune(self._open_idx)
        return LevelChanges(ts, deltas, self.level)

    def take_runs(self) -> FrameRuns | None:
        """The last batch's runs, forgotten here: the batch's records are not held past their application."""
        runs, self.runs = self.runs, None
        return runs

    def _merge_closed(self, fid: int, peak: int) -> None:
        """An event older than the open frame (a late record): into its frame, keeping frames in order.

        ``window_peak`` walks the frames newest first and stops at the first one before the
        window, so a frame appended out of order would hide every older peak behind it.
        The level it reached is taken from the level now (the level back then is not kept):
        the frame's peak is a bound, and the records' own changes are exact.
        """
        frames = self._frames
        i = bisect.bisect_left(frames, fid, key=_frame_id)
        if i < len(frames) and frames[i][0] == fid:
            frames[i] = (fid, max(frames[i][1], peak))
            self._falling_stale = True  # rebuilt at the next window: late records come in bursts, if at all
        elif fid >= self._open_idx - self._keep_frames:
            frames.insert(i, (fid, peak))
            self._falling_stale = True
        self.late_frames += 1

    def add_one(self, ts: int, delta: int) -> LevelChanges:
        return self.add(np.array([ts], dtype=np.int64), np.array([delta], dtype=np.int64))

    def reset(self, ts: int, level: int) -> LevelChanges:
        """Set the level (a resync or a process restart) as an event at ``ts``."""
        return self.add_one(ts, level - self.level)

    def window_peak(self, now_ns: int, window_ns: int) -> int:
        """Highest level over ``[now - window, now]``, boundary rounded to a frame."""
        first = (now_ns - window_ns) // self.frame_ns
        last = now_ns // self.frame_ns
        best = self.level
        if first <= self._open_idx <= last:
            best = max(best, self._open_peak)
        frames = self._frames
        if not frames or frames[-1][0] < first:
            return best
        if last >= frames[-1][0]:  # the window reaches the newest closed frame (a snapshot's always does)
            falling = self._falling_frames()
            i = bisect.bisect_left(falling, first, key=_frame_id)
            return max(best, falling[i][1])  # i is in range: the newest closed frame is always kept there
        for fid, peak in reversed(frames):  # a window that ends before it: walked
            if fid < first:
                break
            if fid <= last:
                best = max(best, peak)
        return best

    def frames(self) -> list[tuple[int, int]]:
        """(frame start ns, peak bytes) of every frame kept, oldest first."""
        out = [(f * self.frame_ns, p) for f, p in self._frames]
        if self._open_idx >= 0:
            out.append((self._open_idx * self.frame_ns, self._open_peak))
        return out

    def _close_open(self) -> None:
        if self._open_idx >= 0:
            frame = (self._open_idx, self._open_peak)
            self._frames.append(frame)
            if not self._falling_stale:
                falling = self._falling
                while falling and falling[-1][1] <= frame[1]:
                    falling.pop()
                falling.append(frame)

    def _falling_frames(self) -> deque[tuple[int, int]]:
        if self._falling_stale:
            kept: list[tuple[int, int]] = []
            for frame in reversed(self._frames):
                if not kept or frame[1] > kept[-1][1]:
                    kept.append(frame)
            kept.reverse()
            self._falling = deque(kept)
            self._falling_stale = False
        return self._falling

    def _prune(self, newest: int) -> None:
        horizon = newest - self._keep_frames
        frames = self._frames
        while frames and frames[0][0] < horizon:
            frames.popleft()
        falling = self._falling
        while falling and falling[0][0] < horizon:
            falling.popleft()


def _frame_peaks_small(ts: list[int], deltas: list[int], level: int,
                       frame_ns: int) -> tuple[list[int], list[int], list[int], int]:
    """What the numpy path computes, walked: per run of events in one frame, its frame, the highest
    level in it (the level on entering it included) and the level after its last event; and the level
    after the last event."""
    frame_ids: list[int] = []
    peaks: list[int] = []
    ends: list[int] = []
    fid = -1
    peak = 0
    for t, d in zip(ts, deltas):
        f = t // frame_ns
        if f != fid or not frame_ids:
            if frame_ids:
                peaks.append(peak)
                ends.append(level)
            frame_ids.append(f)
            fid, peak = f, level  # the level held on entering the frame
        level += d
        if level > peak:  # noqa: PLR1730 - a comparison, not a call of max, per event
            peak = level
    peaks.append(peak)
    ends.append(level)
    return frame_ids, peaks, ends, level


def _frame_id(frame: tuple[int, int]) -> int:
    return frame[0]
