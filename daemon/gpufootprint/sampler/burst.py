"""Burst frames judged ahead of the walk: up to the frame at which an open anomaly window closes.

Inside a burst the usual rate and range do not move, so each burst frame's judgement (volatile or
calm, and whether the window closes after it) depends only on its own events, the calm count and
the level it leaves; ``ProcessSampler._burst_run`` judges a stretch of frames at once and then moves
its state past them. Two ways to the same answer:

* ``judge_frames``: every frame of the stretch at once, with numpy (a long stretch, many events);
* ``walk_frames``: frame after frame in Python, stopping at the first that closes the window. A
  burst frame holds a few events, and a window usually closes a few frames after its last change,
  while the numpy judgement costs about thirty calls of fixed cost whatever the frames hold.

Both decide as ``ProcessSampler._burst_frame`` does frame by frame (a unit test holds the sampler
with either to what the plain walk leaves).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple

import numpy as np

from gpufootprint.config import SamplerConfig

_MS = 1_000_000
# numpy's methods rather than its functions (np.searchsorted, np.flatnonzero): no Python wrapper per call.


class Judged(NamedTuple):
    """The frames before the one that closes the window, and the walk's state after them."""

    frames: int  # how many (at least 1)
    last_start: int  # memory-event index of the first event of the last of them
    mem_end: int  # memory-event index after them
    ev_end: int  # event index after them
    calm: int  # the window's calm count after them
    last_volatile_end: int


class Window(NamedTuple):
    """What the judgement reads of the open window and the sampler."""

    start: int
    baseline: int
    calm: int
    last_volatile_end: int
    level: int  # the process's level at the cursor
    range_ewma: float
    rate_ewma: float


def _tolerance(cfg: SamplerConfig, baseline: int) -> float:
    return max(cfg.volatile_min_bytes, cfg.volatile_rel_change * max(baseline, cfg.volatile_min_bytes))


def judge_frames(cfg: SamplerConfig, cursor: int, iv: int, frames: int, mem_ts: np.ndarray, ev_ts: np.ndarray,
                 total: np.ndarray, i_mem: int, i_ev: int, win: Window) -> Judged | None:
    """All ``frames`` frames from ``cursor`` at once; None when the first one closes the window.

    About thirty numpy calls whatever the frames hold (a large batch's burst: forty frames, a thousand
    events): the levels are read from one array that starts with the level at the cursor, so each
    frame's entering level, the level it leaves and its range come of one index and two reductions."""
    f1 = np.arange(frames + 1, dtype=np.int64)
    bounds = f1 * iv + cursor  # bounds[f + 1]: the end of frame f
    jm = mem_ts.searchsorted(bounds, "left")
    je = ev_ts.searchsorted(bounds, "left")
    jm[0], je[0] = i_mem, i_ev  # jm[f], jm[f + 1]: frame f's first memory event and the one after its last
    n_ev = je[1:] - je[:-1]
    # tp[k]: the level after memory event i_mem + k - 1 (tp[0]: at the cursor); frame f enters at
    # tp[a[f]], leaves at tp[a[f + 1]] and holds tp[a[f]:a[f + 1] + 1] on the way.
    a = jm - i_mem
    tp = np.empty(int(a[-1]) + 1, np.int64)
    tp[0] = win.level
    tp[1:] = total[i_mem:int(jm[-1])]
    at = tp[a]
    entering, after = at[:-1], at[1:]
    first = a[:-1]  # reduceat: tp[a[f]:a[f + 1]] (tp[a[f]] alone for a frame without events; the last to the end)
    rng = np.maximum(np.maximum.reduceat(tp, first), after) - np.minimum(np.minimum.reduceat(tp, first), after)
    ends, f1 = bounds[1:], f1[1:]
    if cfg.enabled:
        volatile = ((rng >= max(cfg.volatile_min_bytes, 1))
                    & (rng >= cfg.volatile_rel_change * np.maximum(entering, cfg.volatile_min_bytes))
                    & (rng > cfg.range_jump_factor * win.range_ewma))
        volatile |= (n_ev >= cfg.rate_min_events) & (
            n_ev / (iv / 1e9) >= cfg.rate_jump_factor * max(win.rate_ewma, cfg.quiet_max_rate))
        # The last volatile frame up to each (its f + 1), or -calm before any: calm = f + 1 - mx either way.
        mx = np.maximum.accumulate(np.where(volatile, f1, -win.calm))
    else:
        mx = np.full(frames, -win.calm, np.int64)
    calm = f1 - mx
    bounds[0] = win.last_volatile_end  # bounds[mx]: the end of the last volatile frame, or the window's
    lve = bounds[np.maximum(mx, 0)]
    closes = (calm >= cfg.burst_min_frames) & ((np.abs(after - win.baseline) < _tolerance(cfg, win.baseline))
                                              | (ends - lve >= cfg.burst_settle_ms * _MS))
    # burst_max_ms closes every frame from the first that ends that long after the window's start.
    c = min(frames, max(0, -(-(cfg.burst_max_ms * _MS + win.start - cursor) // iv) - 1))
    k = int(closes.argmax())
    if k < c and closes[k]:
        c = k
    if c == 0:
        return None
    last = c - 1
    return Judged(c, jm.item(last), jm.item(c), je.item(c), calm.item(last), lve.item(last))


def judge_few_frames(cfg: SamplerConfig, cursor: int, iv: int, frames: int, mem_ts: np.ndarray, ev_ts: np.ndarray,
                     total: np.ndarray, i_mem: int, i_ev: int, win: Window) -> Judged | None:
    """``walk_frames``'s judgement of a few frames that hold many events: each frame's events found with
    one ``searchsorted`` for all of them, its range with two reductions, the decisions in Python, stopping
    at the frame that closes the window. ``judge_frames`` costs about thirty numpy calls whatever the
    frames hold; a large batch's walk judges two or three frames of hundreds of events each."""
    ends = [cursor + iv * (f + 1) for f in range(frames)]
    jm = np.searchsorted(mem_ts, ends, "left").tolist()
    je = np.searchsorted(ev_ts, ends, "left").tolist()
    tolerance = _tolerance(cfg, win.baseline)
    settle_ns, max_ns = cfg.burst_settle_ms * _MS, cfg.burst_max_ms * _MS
    secs = iv / 1e9
    rate_floor = cfg.rate_jump_factor * max(win.rate_ewma, cfg.quiet_max_rate)
    range_floor = cfg.range_jump_factor * win.range_ewma
    calm, lve, level = win.calm, win.last_volatile_end, win.level
    pm, pe = i_mem, i_ev  # the frame's first memory event and event
    judged: tuple[int, int, int, int, int, int] | None = None
    for f in range(frames):
        end, qm, qe = ends[f], jm[f], je[f]
        entering = after = level
        rng = 0
        if qm > pm:
            seg = total[pm:qm]
            after = int(total[qm - 1])
            rng = max(entering, int(seg.max())) - min(entering, int(seg.min()))
        events = qe - pe
        volatile = cfg.enabled and (
            (rng >= cfg.volatile_min_bytes and rng > 0
             and rng >= cfg.volatile_rel_change * max(entering, cfg.volatile_min_bytes) and rng > range_floor)
            or (events >= cfg.rate_min_events and events / secs >= rate_floor))
        if volatile:
            calm, lve = 0, end
        else:
            calm += 1
        back = abs(after - win.baseline) < tolerance
        if (calm >= cfg.burst_min_frames and (back or end - lve >= settle_ns)) or end - win.start >= max_ns:
            break
        judged = (f + 1, pm, qm, qe, calm, lve)
        level, pm, pe = after, qm, qe
    if judged is None:
        return None
    return Judged(*judged)


def walk_frames(cfg: SamplerConfig, cursor: int, iv: int, frames: int, mem_ts: list[int], ev_ts: list[int],
                total: list[int], i_mem: int, i_ev: int, win: Window) -> Judged | None:
    """The same judgement frame after frame, stopping at the one that closes the window.

    ``mem_ts``, ``ev_ts`` and ``total`` are the walk's arrays from ``i_mem`` / ``i_ev`` on, as lists,
    holding at least every event before the end of the ``frames`` frames.

    Frames without events are passed a stretch at a time (``_calm_frames``): most walked frames are the
    empty ones a window waits through before it closes (``burst_settle_ms`` is twenty 5 ms frames)."""
    tolerance = _tolerance(cfg, win.baseline)
    settle_ns, max_ns = cfg.burst_settle_ms * _MS, cfg.burst_max_ms * _MS
    secs = iv / 1e9
    rate_floor = cfg.rate_jump_factor * max(win.rate_ewma, cfg.quiet_max_rate)
    range_floor = cfg.range_jump_factor * win.range_ewma
    calm, lve, level = win.calm, win.last_volatile_end, win.level
    n_mem, n_ev = len(mem_ts), len(ev_ts)
    # An empty frame is calm only when no event is no rate jump (rate_min_events >= 1, as the config's
    # bounds have it); else each frame is judged as it comes.
    skip = cfg.rate_min_events >= 1
    pm = pe = 0  # the frame's first memory event and event, in the lists
    judged: tuple[int, int, int, int, int, int] | None = None
    f = 0
    while f < frames:
        end = cursor + iv * (f + 1)
        if skip and (pm == n_mem or mem_ts[pm] >= end) and (pe == n_ev or ev_ts[pe] >= end):
            # Frames f, f + 1, ... up to the one holding the next event are empty: judged together.
            nxt = min(mem_ts[pm] if pm < n_mem else end + frames * iv, ev_ts[pe] if pe < n_ev else end + frames * iv)
            empty = min(frames, (nxt - cursor) // iv) - f  # at least 1: nothing comes before ``end``
            k = _calm_frames(cfg, end, iv, calm, lve, abs(level - win.baseline) < tolerance, win.start)
            if k < empty:  # the (k + 1)-th of them closes the window
                if k:
                    judged = (f + k, pm, pm, pe, calm + k, lve)
                break
            f += empty
            calm += empty
            judged = (f, pm, pm, pe, calm, lve)
            continue
        # The first event at or after the frame's end (the lists are in time order).
        qm = bisect_left(mem_ts, end, pm) if pm < n_mem and mem_ts[pm] < end else pm
        qe = bisect_left(ev_ts, end, pe) if pe < n_ev and ev_ts[pe] < end else pe
        entering = after = level
        rng = 0
        if qm > pm:
            seg = total[pm:qm]
            after = seg[-1]
            rng = max(entering, max(seg)) - min(entering, min(seg))
        events = qe - pe
        volatile = cfg.enabled and (
            (rng >= cfg.volatile_min_bytes and rng > 0
             and rng >= cfg.volatile_rel_change * max(entering, cfg.volatile_min_bytes) and rng > range_floor)
            or (events >= cfg.rate_min_events and events / secs >= rate_floor))
        if volatile:
            calm, lve = 0, end
        else:
            calm += 1
        back = abs(after - win.baseline) < tolerance
        if (calm >= cfg.burst_min_frames and (back or end - lve >= settle_ns)) or end - win.start >= max_ns:
            break
        f += 1
        judged = (f, pm, qm, qe, calm, lve)
        level, pm, pe = after, qm, qe
    if judged is None:
        return None
    c, start, mem_end, ev_end, calm, lve = judged
    return Judged(c, i_mem + start, i_mem + mem_end, i_ev + ev_end, calm, lve)


def _calm_frames(cfg: SamplerConfig, end: int, iv: int, calm: int, lve: int, back: bool, start: int) -> int:
    """How many calm frames in a row, the first ending at ``end``, pass before one closes the window (that
    one is the next): each adds one to ``calm`` and moves ``end`` by ``iv``, the level and so ``back``
    stay, and the window closes at the first frame where ``calm >= burst_min_frames`` and (``back`` or
    ``end - lve >= burst_settle_ms``), or ``end - start >= burst_max_ms``."""
    # Frame k of them ends at end + k * iv with calm + k + 1 calm frames.
    k = max(0, cfg.burst_min_frames - calm - 1)
    if not back:
        k = max(k, -(-(cfg.burst_settle_ms * _MS - (end - lve)) // iv))
    return min(k, max(0, -(-(cfg.burst_max_ms * _MS - (end - start)) // iv)))
