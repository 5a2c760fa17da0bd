"""The CUDA Graph advisor's evidence from the host: launch and wait calls (pure numpy).

A launch window (probe/launches.py) records, per thread, when each kernel launch call and each
wait for the GPU (a synchronize, a synchronous copy) began and ended; no kernel name, no GPU
time. What that gives:

* **The step.** A training loop waits for the GPU once a step (``loss.item()``, a synchronize):
  the launches between two waits are one step. Waits with no launch between them (a copy, then a
  synchronize) are one wait. The step's launch count is the advisor's op count when most steps
  share it.
* **Bounds on the mean kernel duration.** After a wait returns the GPU has nothing queued, so
  every kernel of the next step ran between that step's first launch and the end of its wait:
  their mean is *at most* that span over the launch count (exact, for kernels on the stream waited
  for). While the host waited the GPU was running the step's remaining kernels: their mean is *at
  least* the wait over the launch count (close to exact: kernels of one stream run back to back
  once queued). A policy bound is decided when the whole interval lies on one side of it; else it is
  unknown, and a window of kernel records (``sampler.kernel_window_records: kernels``) would time the
  kernels themselves.

The thread with the most launches speaks for the process (a training loop launches from one).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from gpufootprint.records import ApiRole

#: API records further apart than this belong to different windows (windows are at least 1 s apart
#: by default; a step is analysed only within one window).
WINDOW_GAP_NS = 500_000_000


@dataclass(frozen=True, slots=True)
class LaunchStats:
    dev: int
    tid: int
    launches: int  # kernel launch calls in the retained records of this thread
    graph_launches: int  # cudaGraphLaunch calls
    waits: int  # waits for the GPU (consecutive ones counted once)
    windows: int  # launch windows the records came from
    period: int | None  # launches per step (between two waits) that most steps share; None: no step found
    steps: int  # whole steps seen (all windows)
    match_ratio: float | None  # share of those steps with exactly ``period`` launches
    step_seconds: float | None  # mean wall time of such a step, wait end to wait end
    launch_seconds: float | None  # of it, the host launching: first launch start to last launch end
    wait_seconds: float | None  # of it, the host waiting for the GPU
    kernel_seconds_max: float | None  # the mean kernel duration is at most this ...
    kernel_seconds_min: float | None  # ... and at least this

    @property
    def graph_share(self) -> float:
        calls = self.launches + self.graph_launches
        return self.graph_launches / calls if calls else 0.0


def launch_stats(api: np.ndarray, *, min_match: float = 0.9, min_steps: int = 3) -> LaunchStats | None:
    """The statistics of the busiest launching thread in an ``RecordKind.API`` array (None: no launch)."""
    if len(api) == 0:
        return None
    launching = api[(api["role"] == ApiRole.LAUNCH) | (api["role"] == ApiRole.GRAPH_LAUNCH)]
    if len(launching) == 0:
        return None
    tids, counts = np.unique(launching["tid"], return_counts=True)
    tid = int(tids[int(np.argmax(counts))])
    mine = api[api["tid"] == tid]
    mine = mine[np.argsort(mine["start"], kind="stable")]
    dev = int(np.bincount(mine["dev"].astype(np.intp)).argmax())
    role = mine["role"]
    start = mine["start"].astype(np.int64)
    end = np.maximum(mine["end"].astype(np.int64), start)
    cuts = np.flatnonzero(np.diff(start) > WINDOW_GAP_NS) + 1
    steps: list[tuple[int, int, int, int, int]] = []  # (launches, step ns, launch ns, wait ns, span ns)
    waits = 0
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(mine)], strict=True):
        waits += _steps(role[lo:hi], start[lo:hi], end[lo:hi], steps)
    period = match = step_s = launch_s = wait_s = k_max = k_min = None
    n_steps = 0
    counts_per_step = np.array([s[0] for s in steps if s[0] > 0], dtype=np.int64)
    if len(counts_per_step) >= min_steps:
        values, freq = np.unique(counts_per_step, return_counts=True)
        best = int(np.argmax(freq))
        share = float(freq[best]) / len(counts_per_step)
        if int(freq[best]) >= min_steps and share >= min_match:
            period, match = int(values[best]), share
            chosen = np.array([s for s in steps if s[0] == period], dtype=np.int64)
            n_steps = len(chosen)
            step_s, launch_s, wait_s = (float(chosen[:, i].mean()) / 1e9 for i in (1, 2, 3))
            k_max = float(chosen[:, 4].mean()) / period / 1e9
            k_min = min(k_max, wait_s / period)
    return LaunchStats(dev=dev, tid=tid, launches=int(np.count_nonzero(role == ApiRole.LAUNCH)),
                       graph_launches=int(np.count_nonzero(role == ApiRole.GRAPH_LAUNCH)), waits=waits,
                       windows=len(cuts) + 1, period=period, steps=n_steps, match_ratio=match, step_seconds=step_s,
                       launch_seconds=launch_s, wait_seconds=wait_s, kernel_seconds_max=k_max, kernel_seconds_min=k_min)


def _steps(role: np.ndarray, start: np.ndarray, end: np.ndarray,
           out: list[tuple[int, int, int, int, int]]) -> int:
    """Append the whole steps of one window to ``out``; return how many waits it held.

    A step runs from the end of one wait to the end of the next, with at least one launch between;
    waits with no launch between them are one wait (its time, first start to last end)."""
    launched = np.cumsum((role == ApiRole.LAUNCH) | (role == ApiRole.GRAPH_LAUNCH))
    waits: list[tuple[int, int, int, int]] = []  # (first record, last record, start, end) of each wait
    for i in np.flatnonzero(role == ApiRole.SYNC).tolist():
        if waits and launched[i] == launched[waits[-1][1]]:  # no launch since that wait: the same wait
            first, _, s, e = waits[-1]
            waits[-1] = (first, i, s, max(e, int(end[i])))
        else:
            waits.append((i, i, int(start[i]), int(end[i])))
    for (_, last0, _, e0), (first1, _, s1, e1) in itertools.pairwise(waits):
        idx = np.flatnonzero(role[last0 + 1:first1] == ApiRole.LAUNCH) + last0 + 1
        if len(idx) == 0:
            continue  # graph launches only: counted, not a step of kernel launches
        first_start, last_end = int(start[idx[0]]), int(end[idx[-1]])
        out.append((len(idx), e1 - e0, last_end - first_start, e1 - s1, e1 - first_start))
    return len(waits)
