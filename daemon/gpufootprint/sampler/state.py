"""The adaptive sampler: one state machine per process, in event time.

The sampler walks a process's timeline in intervals, each closed once the
process's watermark has passed its end (so it saw every record in it, in time
order). After each interval it picks the next one:

* volatile (the footprint moved by ``volatile_rel_change`` of its level, at
  least ``volatile_min_bytes`` and ``range_jump_factor`` times the usual move, or
  the event rate jumped ``rate_jump_factor`` times the usual): a burst. Because
  records wait in the reorder buffer anyway, the burst starts *at the change
  that made the interval volatile* (the first at which the footprint's range
  met the rule), not after it: the interval is cut there and the
  timeline from that point is walked again in ``burst_ms`` frames. An anomaly
  window opens at that frame and closes once ``burst_min_frames`` calm frames
  have passed and the level is back near where it was before (or has held a new
  level for ``burst_settle_ms``). Its peak is the highest level any event
  reached inside it: exact, since every level change is an event.
* quiet (few events, footprint flat): the interval doubles, up to ``max_ms``.
* otherwise: ``steady_ms``.

No clock is read here: time is the records' own, so a replay gives the same
intervals and windows as the live run did.

Why about 460 lines in one module: it is one state machine (intervals, bursts,
windows) over one process's timeline; the judgement of burst frames in blocks
is a room of its own (``sampler/burst.py``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufootprint.config import SamplerConfig
from gpufootprint.sampler.burst import Window, judge_few_frames, judge_frames, walk_frames
from gpufootprint.snapshot import AnomalyWindow

QUIET, STEADY, BURST = "quiet", "steady", "burst"
MODES = (QUIET, STEADY, BURST)
_MS = 1_000_000
_MIXED = -1  # ``ProcessSampler._mem_dev`` when the waiting level changes may be of several devices
# numpy's methods (a.searchsorted, a.cumsum, m.nonzero()[0]) rather than its functions: a function
# dispatches through a Python wrapper, about half a microsecond, and a walk makes dozens of such calls.
_SMALL = 64  # events in a step below which per-device levels are walked in Python
_WALK_FRAMES = 32  # burst frames judged in Python at a time (``_burst_run``) ...
_WALK_EVENTS = 64  # ... when they hold at most this many events of each list
_WALK_MANY = 256  # ... or, found by two searches, at most this many events in all
_FEW_FRAMES = 8  # more events than that in at most this many frames: judged in Python, their ranges with numpy
# What a walk without new events starts from (read-only: shared by every walk, never written).
_NO_TIMES = np.zeros(0, np.int64)
_NO_DELTAS = np.zeros(0, np.int64)
_NO_DEVS = np.zeros(0, np.int32)
for _empty in (_NO_TIMES, _NO_DELTAS, _NO_DEVS):
    _empty.flags.writeable = False


@dataclass
class _OpenWindow:
    start: int
    reason: str
    gpu: int
    baseline: int  # the process's GPU-resident bytes just before the window
    peak: dict[int, int]  # per device, exact
    calm: int = 0
    last_volatile_end: int = 0


def _few_before(ts: np.ndarray, i: int, stop: int) -> bool:
    """Whether at most _WALK_EVENTS events from ``i`` on come before ``stop`` (``ts`` in time order): then
    the _WALK_EVENTS + 1 from ``i`` hold every one of them (read before a list of them is made)."""
    k = i + _WALK_EVENTS
    return k >= len(ts) or ts[k] >= stop


def _filled(n: int, dev: int) -> np.ndarray:
    """``np.full(n, dev, np.int32)`` without ``np.full``'s Python wrapper (about 0.2 us of 0.6, once a batch)."""
    out = np.empty(n, np.int32)
    out.fill(dev)
    return out


def _first(mem_ts: np.ndarray, i_mem: int, ev_ts: np.ndarray, i_ev: int) -> int:
    """The time of the first event from ``i_mem`` / ``i_ev`` on (at least one is there)."""
    return int(min(mem_ts[i_mem:i_mem + 1].tolist() + ev_ts[i_ev:i_ev + 1].tolist()))


def _joined_in_order(chunks: list[np.ndarray]) -> bool:
    """Whether ``chunks`` joined end to end are in time order, each chunk being so (``add_levels``' contract,
    and what a walk keeps of one): when each starts no earlier than the last one before it ended. A few
    comparisons of numbers in Python, not one of every record's time with its neighbour's."""
    last = None
    for c in chunks:
        if len(c):
            if last is not None and c.item(0) < last:
                return False
            last = c.item(-1)
    return True


class ProcessSampler:
    def __init__(self, pid: int, config: SamplerConfig) -> None:
        self.pid = pid
        self.config = config
        self.mode = STEADY
        self.interval_ns = config.steady_ms * _MS
        self.cursor: int | None = None  # start of the interval being filled (event time)
        self.level = 0  # process GPU-resident bytes at the cursor
        self.level_dev: dict[int, int] = {}
        self.rate_ewma: float | None = None
        self.range_ewma: float | None = None
        self.history: deque[list[Any]] = deque(maxlen=config.history)  # [start, end, interval ms, mode, n]
        self.closed_windows: list[AnomalyWindow] = []  # closed since the hub last took them
        self.window: _OpenWindow | None = None
        self.last_peak: dict[int, int] = {}  # peak per device of the last closed interval
        self.bursts = 0
        self._mem: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ts, delta, dev), each sorted
        # The device of every level change in ``_mem`` when they share one (_MIXED: perhaps several),
        # known as they come: a walk need not compare every record's device to find it out.
        self._mem_dev = _MIXED
        self._events: list[np.ndarray] = []  # timestamps of every record (rate)
        self._one_dev: int | None = None  # set per walk: the only device in it, if one
        self.bulk_bursts = True  # burst frames judged together (off: one by one, for tests)
        self.steps = 0  # calls of advance and finish: what the last peaks are as of (the hub keeps features by it)
        self.bulk_steady = True  # the sampler off: empty intervals passed together (off: one by one, for tests)
        self.walk_bursts = True  # ... a few frames of few events in Python (off: always with numpy, for tests)
        self.wait_in_frame = True  # new records inside an unfinished burst frame wait untouched (off: for tests)

    # --- input ----------------------------------------------------------------------

    def add_levels(self, ts: np.ndarray, deltas: np.ndarray, dev: int) -> None:
        """GPU-resident level changes of one device, in time order (one per memory record)."""
        self._mem_dev = dev if not self._mem or self._mem_dev == dev else _MIXED
        # (The deltas as they come when they are int64 already: the sampler only reads them, as the footprint does.)
        self._mem.append((ts.astype(np.int64), deltas.astype(np.int64, copy=False), _filled(len(ts), dev)))

    def add_events(self, ts: np.ndarray) -> None:
        """Timestamps of records that are events but move no level (copies, sets, pools, ...)."""
        self._events.append(ts.astype(np.int64))

    # --- stepping -------------------------------------------------------------------

    def advance(self, watermark: int) -> None:
        """Close every interval that ends at or before ``watermark``."""
        self.steps += 1
        self._run(watermark, final=False)

    def finish(self, end: int) -> None:
        """The stream ended at ``end``: close the last partial interval and any open window."""
        self.steps += 1
        self._run(end, final=True)

    def _run(self, limit: int, final: bool) -> None:
        cfg = self.config
        if not final and self.cursor is not None and self.cursor + self.interval_ns > limit:
            if not self._mem and not self._events:
                return  # nothing new and no interval to close: the common case between ticks
            if self.mode == BURST and self.wait_in_frame and self._nothing_before(self.cursor):
                # A burst frame not over yet: the walk below would stop before judging anything, having
                # merged, summed and split what came only to keep it for the next watermark. It waits as
                # it came (several watermarks fall inside one 5 ms frame of a busy process).
                return
        one_dev = self._mem_dev
        mem_ts, delta, devs = self._take_mem()
        other = self._take_events()
        if len(other):
            ev_ts = np.concatenate([other, mem_ts])
            ev_ts.sort(kind="stable")  # in place: np.sort's wrapper and copy cost more than the sort of a few
        else:
            ev_ts = mem_ts
        if self.cursor is None:
            if len(ev_ts) == 0:
                return
            burst_ns = cfg.burst_ms * _MS
            self.cursor = int(ev_ts[0]) // burst_ns * burst_ns
        cursor = self.cursor
        if len(mem_ts) and mem_ts[0] < cursor:  # late records: they count at the cursor
            mem_ts = np.maximum(mem_ts, cursor)
        if len(ev_ts) and ev_ts[0] < cursor:
            ev_ts = np.maximum(ev_ts, cursor)
        # Levels after each event: the process total and each device's own.
        moved = delta.cumsum() if len(delta) else _NO_TIMES
        total = self.level + moved if len(delta) else _NO_TIMES
        # One device (the common case) needs no per-device masks.
        if not len(devs):
            self._one_dev = None
        elif one_dev != _MIXED:
            self._one_dev = one_dev
        else:
            self._one_dev = int(devs[0]) if devs[0] == devs[-1] and bool((devs == devs[0]).all()) else None
        if self._one_dev is not None:
            base = self.level_dev.get(self._one_dev, 0)
            # A process on one device: its level is the device's, and so are the sums (read only below).
            per_dev = total if base == self.level else base + moved
        elif not len(devs):
            per_dev = _NO_TIMES
        else:
            per_dev = np.empty_like(total)
            for d in np.unique(devs).tolist():
                sel = devs == d
                per_dev[sel] = self.level_dev.get(d, 0) + delta[sel].cumsum()
        i_mem = i_ev = 0
        n_mem, n_ev = len(mem_ts), len(ev_ts)
        closes = False  # the frame at the cursor closes the window: the last judgement ahead stopped before it
        while True:
            iv = self.interval_ns
            end = cursor + iv
            early = False
            if end > limit:
                if cursor >= limit:
                    break
                if not final:
                    # The interval is not over, but what is known of it may already be volatile:
                    # bursting now (not at its end) is what lets the probe be told in time.
                    if self.mode == BURST:
                        break
                    early = True
                end = limit  # a partial interval: only a burst may start from it
            # Nothing happens for a while in a quiet process at its longest interval: skip in bulk.
            # (``item``: a Python int straight from the array, not a numpy scalar converted.)
            nxt = min(mem_ts.item(i_mem) if i_mem < n_mem else limit, ev_ts.item(i_ev) if i_ev < n_ev else limit)
            if (self.mode == QUIET and iv == cfg.max_ms * _MS and self.window is None
                    and end == cursor + iv and nxt >= end):
                k = max(1, (min(nxt, limit) - cursor) // iv)
                self._record(cursor, cursor + k * iv, QUIET, k)
                self._decay(k)  # k empty intervals: the usual rate and range fall as if each was seen
                for d in self.level_dev:
                    self.last_peak[d] = self.level_dev[d]
                cursor += k * iv
                continue
            if (not cfg.enabled and self.bulk_steady and self.mode == STEADY and self.window is None
                    and end == cursor + iv and nxt >= end):
                # The sampler off: every interval is a steady one. Empty ones in bulk too, as a quiet
                # process's are: a gap of a year (a record stamped in 1970, then one now) was walked 20 ms
                # at a time, hours of the ingest thread.
                k = max(1, (min(nxt, limit) - cursor) // iv)
                self._update_usual(0, 0, iv / 1e9)
                self._decay(k - 1)
                for d in self.level_dev:
                    self.last_peak[d] = self.level_dev[d]
                self._record(cursor, cursor + k * iv, STEADY, k, iv)
                self.interval_ns = cfg.steady_ms * _MS
                cursor += k * iv
                continue
            if (self.mode == BURST and self.window is not None and self.bulk_bursts and not closes
                    and end == cursor + iv and limit - cursor >= 2 * iv):
                # A burst walks 5 ms frames one by one: 200 steps a second of a process's time, each a
                # dozen numpy calls, whether the frames hold records or not. The frames before the one
                # that closes the window are judged together (``_burst_run``); that one is walked as usual.
                c = self._burst_run(cursor, iv, (limit - cursor) // iv, mem_ts, ev_ts, total, devs, per_dev,
                                    i_mem, i_ev)
                if c is not None:
                    cursor, i_mem, i_ev, closes = c
                    continue
            # (Judged ahead again from a frame that closes, the judgement would stop at once: it is walked.)
            closes = False
            if nxt >= end:  # no event before the interval's end (events before i_mem/i_ev all came before it)
                j_mem, j_ev = i_mem, i_ev
            else:
                j_mem = int(mem_ts.searchsorted(end, "left"))
                j_ev = int(ev_ts.searchsorted(end, "left"))
            n_events = j_ev - i_ev
            lv = total[i_mem:j_mem]
            entering = self.level
            hi = max(entering, int(lv.max())) if len(lv) else entering
            lo = min(entering, int(lv.min())) if len(lv) else entering
            rng = hi - lo
            # Rates are over the whole interval even when only part is known (a lower bound), so
            # a partial interval bursts only when the whole one would: the result does not depend
            # on where the watermarks fell.
            secs = iv / 1e9 if early else (end - cursor) / 1e9
            if self.mode != BURST:
                reason = self._volatile(rng, entering, n_events, secs)
                if reason is not None:
                    first = self._volatile_change(mem_ts, total, i_mem, j_mem, entering) \
                        if reason == "footprint_change" else int(ev_ts[i_ev])
                    burst_ns = cfg.burst_ms * _MS
                    t1 = max(cursor, first // burst_ns * burst_ns)
                    if t1 > cursor:
                        self._record(cursor, t1, self.mode, 1)
                        # The usual rate and range learn only from the part sampled in the old mode
                        # (only changes too small to count moved a level), again independent of the
                        # watermarks.
                        n_before = int(ev_ts.searchsorted(t1, "left")) - i_ev
                        before = total[i_mem:int(mem_ts.searchsorted(t1, "left"))]
                        rng_before = (max(entering, int(before.max())) - min(entering, int(before.min()))
                                      if len(before) else 0)
                        self._update_usual(rng_before, n_before, (t1 - cursor) / 1e9)
                    gpu = self._busiest_dev(devs, per_dev, i_mem, j_mem)
                    k_mem = int(mem_ts.searchsorted(t1, "left"))
                    if k_mem > i_mem:  # small changes before the one that mattered: the levels move on
                        self._levels_to(devs, total, per_dev, i_mem, k_mem)
                    self.window = _OpenWindow(start=t1, reason=reason, gpu=gpu, baseline=self.level,
                                              peak=dict(self.level_dev), last_volatile_end=t1)
                    self.mode, self.interval_ns = BURST, burst_ns
                    self.bursts += 1
                    # Walk again from t1, from the levels just before it.
                    i_mem = k_mem
                    i_ev = int(ev_ts.searchsorted(t1, "left"))
                    cursor = t1
                    continue
            if early:
                break
            # The interval is closed as sampled: note its peaks, move the levels to its end.
            peaks = self._dev_peaks(devs, per_dev, i_mem, j_mem)
            self.last_peak = peaks
            if j_mem > i_mem:
                self._levels_to(devs, total, per_dev, i_mem, j_mem)
            sampled_mode = self.mode
            if self.mode == BURST:
                self._burst_frame(end, rng, entering, n_events, secs, peaks)
            else:
                quiet = self._quiet(rng, entering, n_events, secs)
                self._update_usual(rng, n_events, secs)
                if quiet:
                    self.mode = QUIET
                    self.interval_ns = min(iv * 2, cfg.max_ms * _MS)
                else:
                    self.mode, self.interval_ns = STEADY, cfg.steady_ms * _MS
            self._record(cursor, end, sampled_mode, 1, iv)
            i_mem, i_ev = j_mem, j_ev
            cursor = end
        if final and self.window is not None:
            self._close_window(max(cursor, limit))
        if final and self.mode == BURST:
            self.mode, self.interval_ns = STEADY, cfg.steady_ms * _MS
        self.cursor = cursor
        # What the walk did not reach waits for the next watermark; its levels are
        # recomputed then from self.level, the level at the cursor.
        if i_mem < n_mem:
            self._mem = [(mem_ts[i_mem:], delta[i_mem:], devs[i_mem:])]
        rest = other[int(other.searchsorted(cursor, "left")):] if len(other) else other
        if len(rest):
            self._events = [rest]

    # --- decisions ------------------------------------------------------------------

    def _volatile(self, rng: int, entering: int, n_events: int, secs: float) -> str | None:
        cfg = self.config
        if not cfg.enabled:
            return None
        floor = max(entering, cfg.volatile_min_bytes)
        if (rng >= cfg.volatile_min_bytes and rng > 0 and rng >= cfg.volatile_rel_change * floor
                and rng > cfg.range_jump_factor * (self.range_ewma or 0.0)):
            return "footprint_change"
        rate = n_events / secs if secs > 0 else 0.0
        if n_events >= cfg.rate_min_events and rate >= cfg.rate_jump_factor * max(self.rate_ewma or 0.0,
                                                                                  cfg.quiet_max_rate):
            return "event_rate"
        return None

    def _quiet(self, rng: int, entering: int, n_events: int, secs: float) -> bool:
        cfg = self.config
        if not cfg.enabled:
            return False
        rate = n_events / secs if secs > 0 else 0.0
        return rate <= cfg.quiet_max_rate and rng <= cfg.quiet_rel_change * max(entering, cfg.volatile_min_bytes)

    def _update_usual(self, rng: int, n_events: int, secs: float) -> None:
        a = self.config.ewma_alpha
        rate = n_events / secs if secs > 0 else 0.0
        self.rate_ewma = rate if self.rate_ewma is None else (1 - a) * self.rate_ewma + a * rate
        self.range_ewma = float(rng) if self.range_ewma is None else (1 - a) * self.range_ewma + a * rng

    def _decay(self, k: int) -> None:
        keep = (1 - self.config.ewma_alpha) ** k
        if self.rate_ewma is not None:
            self.rate_ewma *= keep
        if self.range_ewma is not None:
            self.range_ewma *= keep

    def _burst_run(self, cursor: int, iv: int, frames: int, mem_ts: np.ndarray, ev_ts: np.ndarray,
                   total: np.ndarray, devs: np.ndarray, per_dev: np.ndarray, i_mem: int,
                   i_ev: int) -> tuple[int, int, int, bool] | None:
        """Walk the next ``frames`` whole burst frames from ``cursor`` at once, up to (not including)
        the one at which the open window closes: what ``_burst_frame`` would leave after each of them
        is judged ahead (``sampler.burst``), then the state moves past them. Returns the new
        (cursor, memory index, event index, whether the frame there closes the window), or None when the
        first frame already closes the window."""
        win = self.window
        assert win is not None
        cfg = self.config
        # The window closes by burst_max_ms at the latest: a long gap is not judged frame by frame.
        frames = max(1, min(frames, -(-(win.start + cfg.burst_max_ms * _MS - cursor) // iv)))
        seen = Window(win.start, win.baseline, win.calm, win.last_volatile_end, self.level,
                      self.range_ewma or 0.0, self.rate_ewma or 0.0)
        # A few events in the next frames (the common case: a burst frame holds a few, and the window
        # closes a few frames after the last change): judged frame by frame in Python, at most
        # _WALK_FRAMES of them this time (the walk goes on from there, as after any stretch).
        # Lists one longer than _WALK_EVENTS: when a list ends, or its last event is past those
        # frames, it holds every event before their end.
        walk = min(frames, _WALK_FRAMES)
        stop = cursor + walk * iv
        judging = walk  # how many frames are judged: fewer judged ahead means the next one closes the window
        if self.walk_bursts and _few_before(mem_ts, i_mem, stop) and _few_before(ev_ts, i_ev, stop):
            k_mem, k_ev = i_mem + _WALK_EVENTS + 1, i_ev + _WALK_EVENTS + 1
            judged = walk_frames(cfg, cursor, iv, walk, mem_ts[i_mem:k_mem].tolist(), ev_ts[i_ev:k_ev].tolist(),
                                 total[i_mem:k_mem].tolist(), i_mem, i_ev, seen)
        elif self.walk_bursts and (j_ev := int(ev_ts.searchsorted(stop, "left"))) - i_ev <= _WALK_MANY:
            # More events, in no more frames (kernels by the hundred in a few 5 ms frames): the walk finds
            # each frame's end by bisection, so its cost follows the frames more than the events; numpy's
            # thirty calls judge every frame up to burst_max_ms, most of them after the window closed.
            j_mem = int(mem_ts.searchsorted(stop, "left"))
            judged = walk_frames(cfg, cursor, iv, walk, mem_ts[i_mem:j_mem].tolist(), ev_ts[i_ev:j_ev].tolist(),
                                 total[i_mem:j_mem].tolist(), i_mem, i_ev, seen)
        elif self.walk_bursts and frames <= _FEW_FRAMES:
            judging = frames
            judged = judge_few_frames(cfg, cursor, iv, frames, mem_ts, ev_ts, total, i_mem, i_ev, seen)
        elif self.walk_bursts and (empty := min(frames, (_first(mem_ts, i_mem, ev_ts, i_ev) - cursor) // iv)) > 0 and (
                (judged := walk_frames(cfg, cursor, iv, empty, [], [], [], i_mem, i_ev, seen)) is None
                or judged.frames < empty):
            # The window closes in the frames before the first event (calm frames after a change, a
            # large batch's events further on): walked in Python, as the judgement of all of them would find.
            judging = empty
        else:
            judging = frames
            judged = judge_frames(cfg, cursor, iv, frames, mem_ts, ev_ts, total, i_mem, i_ev, seen)
        if judged is None:
            return None
        c, s_last, j_last, je_last, calm, lve = judged
        # The window's peak per device: the highest level any device held in these frames.
        for d, p in self.level_dev.items():
            win.peak[d] = max(win.peak.get(d, 0), p)
        if s_last > i_mem:
            self._levels_to(devs, total, per_dev, i_mem, s_last)
        peaks = self._dev_peaks(devs, per_dev, s_last, j_last)  # the last frame's, as the walk leaves them
        if s_last > i_mem and self._one_dev is not None:
            d = self._one_dev
            win.peak[d] = max(win.peak.get(d, 0), int(per_dev[i_mem:s_last].max()))
        elif s_last > i_mem:
            sub_dev, sub_lv = devs[i_mem:s_last], per_dev[i_mem:s_last]
            for d in np.unique(sub_dev).tolist():
                win.peak[d] = max(win.peak.get(d, 0), int(sub_lv[sub_dev == d].max()))
        for d, p in peaks.items():
            win.peak[d] = max(win.peak.get(d, 0), p)
        self.last_peak = peaks
        if j_last > s_last:
            self._levels_to(devs, total, per_dev, s_last, j_last)
        win.calm = calm
        win.last_volatile_end = lve
        self._record(cursor, cursor + c * iv, BURST, c, iv)
        return cursor + c * iv, j_last, je_last, c < judging

    def _back(self, win: _OpenWindow) -> bool:
        cfg = self.config
        tolerance = max(cfg.volatile_min_bytes, cfg.volatile_rel_change * max(win.baseline, cfg.volatile_min_bytes))
        return abs(self.level - win.baseline) < tolerance

    def _burst_frame(self, end: int, rng: int, entering: int, n_events: int, secs: float,
                     peaks: dict[int, int]) -> None:
        cfg = self.config
        win = self.window
        assert win is not None
        for d, p in peaks.items():
            win.peak[d] = max(win.peak.get(d, 0), p)
        if self._volatile(rng, entering, n_events, secs) is not None:
            win.calm = 0
            win.last_volatile_end = end
        else:
            win.calm += 1
        back = self._back(win)
        settled = end - win.last_volatile_end >= cfg.burst_settle_ms * _MS
        if (win.calm >= cfg.burst_min_frames and (back or settled)) or end - win.start >= cfg.burst_max_ms * _MS:
            self._close_window(end)
            self.mode, self.interval_ns = STEADY, cfg.steady_ms * _MS

    def _close_window(self, end: int) -> None:
        win = self.window
        assert win is not None
        self.closed_windows.append(AnomalyWindow(pid=self.pid, gpu=win.gpu, start_ns=win.start, end_ns=end,
                                                 reason=win.reason, peak_bytes=win.peak.get(win.gpu, 0)))
        self.window = None

    # --- helpers ----------------------------------------------------------------------

    def _volatile_change(self, mem_ts: np.ndarray, total: np.ndarray, i: int, j: int, entering: int) -> int:
        """The time of the level change that made the interval volatile: the first at which the
        range of levels since the interval began meets the footprint rule. Small changes before
        it (a 1 KiB allocation) are not where the burst starts: a window opened there would
        close, calm, before the change that mattered, its peak only the baseline."""
        lv = total[i:j]
        if len(lv) == 0:
            return int(mem_ts[i]) if i < len(mem_ts) else 0
        cfg = self.config
        floor = max(entering, cfg.volatile_min_bytes)
        need = max(cfg.volatile_min_bytes, cfg.volatile_rel_change * floor, 1)
        usual = cfg.range_jump_factor * (self.range_ewma or 0.0)
        if len(lv) <= _SMALL:
            # A few changes (a quiet process's flush): walked, as numpy's eight calls cost more than the walk.
            top = bottom = entering
            for k, v in enumerate(lv.tolist()):
                if v > top:  # noqa: PLR1730 - comparisons, not calls of max and min, per event
                    top = v
                if v < bottom:  # noqa: PLR1730
                    bottom = v
                if top - bottom >= need and top - bottom > usual:
                    return int(mem_ts.item(i + k))
            return int(mem_ts.item(i))
        hi = np.maximum.accumulate(np.maximum(lv, entering))
        lo = np.minimum.accumulate(np.minimum(lv, entering))
        rng = hi - lo
        hit = ((rng >= need) & (rng > usual)).nonzero()[0]
        return int(mem_ts[i + int(hit[0])]) if len(hit) else int(mem_ts[i])

    def _levels_to(self, devs: np.ndarray, total: np.ndarray, per_dev: np.ndarray, i: int, j: int) -> None:
        """Move the levels to after event ``j - 1`` (events ``i`` to ``j`` were walked)."""
        self.level = total.item(j - 1)
        if self._one_dev is not None:
            self.level_dev[self._one_dev] = per_dev.item(j - 1)
            return
        if j - i <= _SMALL:
            # A few events: a dict built in order keeps each device's last level (numpy's unique and
            # a mask per device cost more than the walk).
            self.level_dev.update(zip(devs[i:j].tolist(), per_dev[i:j].tolist()))
            return
        for d in np.unique(devs[i:j]).tolist():
            last = i + int((devs[i:j] == d).nonzero()[0][-1])
            self.level_dev[d] = int(per_dev[last])

    def _dev_peaks(self, devs: np.ndarray, per_dev: np.ndarray, i: int, j: int) -> dict[int, int]:
        peaks = dict(self.level_dev)
        if j > i and self._one_dev is not None:
            d = self._one_dev
            peaks[d] = max(self.level_dev.get(d, 0), int(per_dev[i:j].max()))
        elif j - i <= _SMALL:
            for d, v in zip(devs[i:j].tolist(), per_dev[i:j].tolist()):
                peaks[d] = max(peaks.get(d, 0), v)
        elif j > i:
            sub_dev, sub_lv = devs[i:j], per_dev[i:j]
            for d in np.unique(sub_dev).tolist():
                peaks[d] = max(self.level_dev.get(d, 0), int(sub_lv[sub_dev == d].max()))
        return peaks

    def _busiest_dev(self, devs: np.ndarray, per_dev: np.ndarray, i: int, j: int) -> int:
        if j <= i:
            return min(self.level_dev) if self.level_dev else 0
        if self._one_dev is not None:
            return self._one_dev  # the only device with events: the busiest
        best, best_rng = int(devs[i]), -1
        sub_dev, sub_lv = devs[i:j], per_dev[i:j]
        for d in np.unique(sub_dev).tolist():
            lv = sub_lv[sub_dev == d]
            base = self.level_dev.get(d, 0)
            rng = max(base, int(lv.max())) - min(base, int(lv.min()))
            if rng > best_rng:
                best, best_rng = d, rng
        return best

    def _record(self, start: int, end: int, mode: str, n: int, iv: int | None = None) -> None:
        iv_ms = (iv if iv is not None else self.interval_ns) // _MS
        last = self.history[-1] if self.history else None
        if last is not None and last[1] == start and last[2] == iv_ms and last[3] == mode:
            last[1] = end
            last[4] += n
        else:
            self.history.append([start, end, iv_ms, mode, n])

    def _nothing_before(self, cursor: int) -> bool:
        """Whether nothing waiting is stamped before ``cursor``. A walk drops such events and moves such
        level changes to the cursor, which orders them among later ones: they must go its way.

        Asked at most watermarks of a burst frame still open (several fall inside one): plain loops and
        ``item``, not generators under ``all`` and numpy scalars converted, which cost about as much again."""
        for ts, _, _ in self._mem:
            if len(ts) and ts.item(0) < cursor:  # level changes: each chunk in time order, its first the earliest
                return False
        for ts in self._events:
            if len(ts) and ts.min() < cursor:  # events: a chunk as it came, in any order
                return False
        return True

    def _take_mem(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        chunks, self._mem = self._mem, []
        if not chunks:
            return _NO_TIMES, _NO_DELTAS, _NO_DEVS
        if len(chunks) == 1:
            return chunks[0]
        ts = np.concatenate([c[0] for c in chunks])
        deltas = np.concatenate([c[1] for c in chunks])
        devs = np.concatenate([c[2] for c in chunks])
        if _joined_in_order([c[0] for c in chunks]):
            # The usual case (what a walk left, then what came since): a stable sort would leave it as it is.
            return ts, deltas, devs
        order = ts.argsort(kind="stable")
        return ts[order], deltas[order], devs[order]

    def _take_events(self) -> np.ndarray:
        chunks, self._events = self._events, []
        if not chunks:
            return _NO_TIMES
        ts = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        ts.sort(kind="stable")  # in place: each chunk is the sampler's own (add_events copies; a walk keeps a sorted rest)
        return ts

    def intervals(self) -> list[dict[str, Any]]:
        return [{"start": s, "end": e, "interval_ms": iv, "mode": m, "count": n} for s, e, iv, m, n in self.history]
