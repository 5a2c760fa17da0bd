"""Per-stream kernel statistics from KERNEL record arrays (pure numpy).

What the CUDA Graph advisor needs from a kernel window: how many kernels make one
repeated step (the period of the kernel-name sequence), how long they run, and
how much of the step the GPU waits between them. Kernels on one stream run one
after another, so the time between one kernel's end and the next one's start is
time the stream was starved: by CPU launch overhead (what a graph removes) or by
host work (what it does not; gaps above ``host_gap_ns`` are counted as that).

A loop of one kernel launched again and again (ten matmuls and a synchronize per
step) repeats its name every kernel: the name sequence says "one kernel a step".
For such a loop the idle gaps above ``host_gap_ns`` (the host's wait and work between
steps) tell the step: their most common spacing, counted from gap to gap at one phase
(``steps_from_gaps``). A longer name period is left alone: gaps every few steps are
host work (logging), not a longer step.

CUPTI sometimes leaves a kernel record's start or end at zero; such a record has no
place in time, so it is left out (and counted) rather than read as a kernel that
started in 1970.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StreamKernelStats:
    dev: int
    stream: int
    kernels: int
    graph_kernels: int  # launched from a captured CUDA graph (graph id != 0)
    span_seconds: float  # first start to last end
    busy_seconds: float
    mean_kernel_seconds: float
    period: int | None  # kernels per repeated step; None: no repetition found
    steps: int  # whole steps observed at that period
    match_ratio: float | None  # share of kernels equal to the one a period earlier
    step_seconds: float | None  # mean wall time of one step
    step_gap_seconds: float | None  # mean time per step the stream sat idle between kernels
    launch_gap_seconds: float | None  # of that, gaps short enough to be launch overhead
    saveable_seconds: float | None  # launch overhead per step a graph would remove
    untimed: int = 0  # records left out: start or end zero
    steps_from_gaps: bool = False  # the step is the spacing of the idle gaps, not the name period

    @property
    def graph_share(self) -> float:
        return self.graph_kernels / self.kernels if self.kernels else 0.0

    @property
    def gap_share(self) -> float | None:
        if self.step_seconds is None or self.step_gap_seconds is None or self.step_seconds <= 0:
            return None
        return self.step_gap_seconds / self.step_seconds


def detect_period(seq: np.ndarray, *, min_match: float = 0.9, min_steps: int = 3,
                  max_period: int = 4096, max_candidates: int = 2000, anchors: int = 16) -> tuple[int, float] | None:
    """Smallest p with ``seq[i] == seq[i + p]`` for at least ``min_match`` of i, seen ``min_steps`` times.

    Candidates are the distances at which one of the last ``anchors`` elements
    recurs: any true period is among them as long as one of those elements belongs
    to the repeating step (a stray kernel after the last step, as when a window
    closes on other work, does not hide it). They are tried shortest first and the
    first that holds wins, so a multiple of the period never hides the period.
    """
    n = len(seq)
    limit = min(max_period, n // min_steps)
    if limit < 1:
        return None
    found: set[int] = set()
    for a in range(n - 1, max(n - 1 - anchors, 0), -1):
        lo = max(0, a - limit)
        where = np.flatnonzero(seq[lo:a] == seq[a]) + lo
        found.update((a - where).tolist())
    for p in sorted(found)[:max_candidates]:
        match = _match(seq, p)
        if match >= min_match:
            return _refine(seq, p, match, limit)
    return None


def _match(seq: np.ndarray, p: int) -> float:
    return float(np.count_nonzero(seq[p:] == seq[:-p])) / (len(seq) - p)


def _refine(seq: np.ndarray, p: int, match: float, limit: int) -> tuple[int, float]:
    """A longer period when the mismatches at ``p`` are themselves periodic.

    100 ``add_`` launches and one optimizer kernel per step match themselves 99 %
    of the time one kernel apart; the step is 101 kernels. Distances between the
    mismatch positions at ``p`` propose multiples of ``p``; one that removes at
    least half of the remaining mismatches replaces it.
    """
    for _ in range(4):
        if match >= 1.0:
            break
        miss = np.flatnonzero(seq[p:] != seq[:-p])
        cands: set[int] = set()
        for k in range(1, 5):
            if len(miss) > k:
                cands.update(np.unique(miss[k:] - miss[:-k]).tolist())
        better = [(q, m) for q in sorted(c for c in cands if p < c <= limit and c % p == 0)
                  if (m := _match(seq, q)) >= match + (1.0 - match) / 2]
        if not better:
            break
        p, match = better[0]
    return p, match


def detect_recent_period(seq: np.ndarray, *, min_match: float = 0.9, min_steps: int = 3,
                         max_period: int = 4096) -> tuple[int, float, int] | None:
    """``detect_period`` on the newest part of ``seq`` that has one: (period, match, kernels used).

    Warm-up steps (lazy optimizer state, autotuning) launch other kernels than the
    steady step; dropping the oldest eighths one at a time, down to half the
    window, lets the steady period show.
    """
    n = len(seq)
    for eighths in range(8, 3, -1):
        m = n * eighths // 8
        found = detect_period(seq[n - m:], min_match=min_match, min_steps=min_steps, max_period=max_period)
        if found is not None:
            return found[0], found[1], m
    return None


def steps_from_gaps(gaps: np.ndarray, *, host_gap_ns: int, min_match: float, min_steps: int,
                    max_period: int) -> tuple[int, int, int] | None:
    """(kernels a step ``q``, first kernel of the first step, first kernel after the last whole step)
    for a loop of one repeated kernel, read from its idle gaps above ``host_gap_ns``; None when they
    do not make steps. ``gaps[i]`` is the idle time after kernel i.

    ``q`` is the most common spacing between such gaps; the gaps that count are those at the most
    common position modulo ``q`` (the step's end), so a stray stall inside a step neither splits it
    nor moves the others. Steps run from the first such gap to the last (the window may open
    mid-step); one must be found after at least ``min_match`` of them, and at least ``min_steps``."""
    starts = np.flatnonzero(gaps > host_gap_ns) + 1
    if len(starts) < min_steps:
        return None
    values, counts = np.unique(np.diff(starts), return_counts=True)
    q = int(values[np.argmax(counts)])
    if q <= 1 or q > max_period:
        return None
    phases, at = np.unique(starts % q, return_counts=True)
    ends = starts[starts % q == phases[np.argmax(at)]]
    lo, hi = int(ends[0]), int(ends[-1])
    n_steps = (hi - lo) // q
    if n_steps < max(1, min_steps - 1) or len(ends) - 1 < min_match * n_steps:
        return None
    return q, lo, hi


def stream_stats(kernels: np.ndarray, *, min_match: float = 0.9, min_steps: int = 3, max_period: int = 4096,
                 analysis_kernels: int = 16384, host_gap_ns: int = 1_000_000,
                 graph_gap_ns: int = 2_000) -> dict[tuple[int, int], StreamKernelStats]:
    """Statistics of every (device, stream) in a KERNEL record array."""
    out: dict[tuple[int, int], StreamKernelStats] = {}
    if len(kernels) == 0:
        return out
    keys = kernels["dev"].astype(np.uint64) << np.uint64(32) | kernels["stream"].astype(np.uint64)
    start = kernels["start"]
    one_key = bool((keys == keys[0]).all())
    for key in np.unique(keys).tolist():
        # Indices first, records last: only the analysed kernels of a stream are copied (the
        # retained window holds up to graph_advisor.kernel_retention of them, re-read at every tick).
        idx = np.arange(len(kernels)) if one_key else np.flatnonzero(keys == key)
        idx = idx[np.argsort(start[idx], kind="stable")][-analysis_kernels:]
        sub = kernels[idx]
        out[(key >> 32, key & 0xFFFFFFFF)] = _one_stream(
            sub, key >> 32, key & 0xFFFFFFFF, min_match=min_match, min_steps=min_steps, max_period=max_period,
            host_gap_ns=host_gap_ns, graph_gap_ns=graph_gap_ns)
    return out


def _one_stream(k: np.ndarray, dev: int, stream: int, *, min_match: float, min_steps: int, max_period: int,
                host_gap_ns: int, graph_gap_ns: int) -> StreamKernelStats:
    timed = (k["start"] != 0) & (k["end"] != 0)
    untimed = len(k) - int(np.count_nonzero(timed))
    k = k[timed]
    n = len(k)
    if n == 0:
        return StreamKernelStats(dev=int(dev), stream=int(stream), kernels=0, graph_kernels=0, span_seconds=0.0,
                                 busy_seconds=0.0, mean_kernel_seconds=0.0, period=None, steps=0, match_ratio=None,
                                 step_seconds=None, step_gap_seconds=None, launch_gap_seconds=None,
                                 saveable_seconds=None, untimed=untimed)
    start = k["start"].astype(np.int64)
    end = np.maximum(k["end"].astype(np.int64), start)
    dur = end - start
    found = detect_recent_period(k["name_id"], min_match=min_match, min_steps=min_steps, max_period=max_period)
    period = match = step_s = gap_s = launch_s = save_s = None
    steps = 0
    by_gaps = False
    if found is not None:
        period, match, used = found
        # gaps[i]: idle time between kernel i and kernel i+1 (overlaps count as none)
        gaps = np.clip(start[1:] - np.maximum.accumulate(end)[:-1], 0, None)
        # A loop of one repeated kernel: its name repeats every kernel, so only the host's gaps tell
        # the step (a longer name period is a step already; gaps every few of them are host work).
        gap_steps = steps_from_gaps(gaps[n - used:], host_gap_ns=host_gap_ns, min_match=min_match,
                                    min_steps=min_steps, max_period=max_period) if period == 1 else None
        if gap_steps is not None:
            by_gaps = True
            period, lo, hi = gap_steps[0], gap_steps[1] + (n - used), gap_steps[2] + (n - used)
            n_full = (hi - lo) // period
            steps = n_full + (1 if n - hi >= period else 0)
        else:
            steps = used // period
            lo = n - steps * period
            n_full = steps - 1  # steps whose following step's first kernel is in the window
            hi = lo + n_full * period
        g = gaps[lo:hi]
        span = int(start[hi] - start[lo])
        step_s = span / n_full / 1e9
        gap_s = float(g.sum()) / n_full / 1e9
        short = g[g <= host_gap_ns]
        launch_s = float(short.sum()) / n_full / 1e9
        save_s = float(np.clip(short - graph_gap_ns, 0, None).sum()) / n_full / 1e9
    return StreamKernelStats(
        dev=int(dev), stream=int(stream), kernels=n, graph_kernels=int(np.count_nonzero(k["graph"])),
        span_seconds=float(end.max() - start.min()) / 1e9, busy_seconds=float(dur.sum()) / 1e9,
        mean_kernel_seconds=float(dur.mean()) / 1e9, period=period, steps=steps, match_ratio=match,
        step_seconds=step_s, step_gap_seconds=gap_s, launch_gap_seconds=launch_s, saveable_seconds=save_s,
        untimed=untimed, steps_from_gaps=by_gaps,
    )
