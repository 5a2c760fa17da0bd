"""The CUDA Graph advisor's evidence from the host: launch and wait calls (pure numpy).

A launch window (probe/launches.py) records, per thread, when each kernel launch call and each
wait for the GPU (a synchronize, a synchronous copy) began and ended; no kernel name, no GPU
time. What that gives:

* **The step.** A training loop waits for the GPU once a step (``loss.item()``, a synchronize):
  the launches between two waits are one step. Waits with no launch between them (a copy, then a
  synchronize) are one wait. The step's launch count is the advisor's op count when most steps
  share it.
* **An upper bound on the mean kernel duration.** After a wait returns the GPU has nothing queued,
  so every kernel of the next step ran between that step's first launch and the end of its wait:
  run one at a time (one stream), their mean is *at most* that span over the launch count. Kernels
  that overlap on several streams can each run longer; a step that also replays a graph runs kernels
  no launch call counts, so such steps give no bound. There is no lower bound: the time the host
  waits can be host work between two waits, a copy's own transfer or other streams' kernels. So a
  policy's upper bound passes (or a lower bound fails) when the mean is at most that; anything else
  is unknown, and a window of kernel records (``sampler.kernel_window_records: kernels``) would time
  the kernels themselves.

The thread with the most launches speaks for the process (a training loop launches from one) when it
waits for the GPU itself. When it never waits, the steps are read from every thread's calls together:
PyTorch launches a step's backward kernels from autograd's device thread while the main thread
launches the forward and the optimizer and waits (a step is then every launch between the main
thread's waits; another thread's unrelated launches make the counts disagree, and no step is found).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpufootprint.records import ApiRole

#: A host idle this long between two recorded calls (one's end to the next one's start) separates two
#: windows (they are at least 1 s apart by default); a step is read only within one window.
WINDOW_GAP_NS = 500_000_000
#: The newest records of the thread read (bounds the work a tick does whatever a probe sends).
MAX_ANALYSED = 65_536


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
    kernel_seconds_max: float | None  # the mean kernel duration is at most this (kernels one at a time)
    # (first start, last end) in ns of the steps read (those with ``period`` launches), per window: where
    # the GPU's busy time is looked up (engines/busy.py)
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def graph_share(self) -> float:
        calls = self.launches + self.graph_launches
        return self.graph_launches / calls if calls else 0.0


def _steady(n: np.ndarray, win: np.ndarray, *, min_steps: int, min_match: float) -> tuple[int, float, int] | None:
    """(launches per step, share of steps with it, first step used) over the longest run of the newest
    steps that agrees: a window's first steps can be warm-up (lazy initialisation, autotuning) and an
    old window another phase of the program, so runs starting at each window's start, or one to three
    steps into it, are tried, longest first. ``n``: each step's launches, ``win``: its window."""
    if len(n) < min_steps:
        return None
    heads = np.flatnonzero(np.r_[True, win[1:] != win[:-1]])
    starts = sorted({int(h) + k for h in heads[-256:].tolist() for k in range(4) if int(h) + k < len(n)})
    for first in starts:
        sub = n[first:]
        if len(sub) < min_steps:
            break
        values, freq = np.unique(sub, return_counts=True)
        best = int(np.argmax(freq))
        share = float(freq[best]) / len(sub)
        if int(freq[best]) >= min_steps and share >= min_match:
            return int(values[best]), share, first
    return None


def launch_stats(api: np.ndarray, *, min_match: float = 0.9, min_steps: int = 3) -> LaunchStats | None:
    """The statistics of the busiest launching thread in an ``RecordKind.API`` array (None: no launch).

    Vectorised throughout: the work is a few passes over at most ``MAX_ANALYSED`` records, whatever
    their pattern (a probe decides what it sends)."""
    if len(api) == 0:
        return None
    role_all = api["role"]
    launching = api[(role_all == ApiRole.LAUNCH) | (role_all == ApiRole.GRAPH_LAUNCH)]
    if len(launching) == 0:
        return None
    tids, counts = np.unique(launching["tid"], return_counts=True)
    tid = int(tids[int(np.argmax(counts))])
    mine = api[api["tid"] == tid]
    if np.count_nonzero(mine["role"] == ApiRole.SYNC) < 2:
        mine = api  # the busiest thread never waits: the steps are read from all threads' calls
    mine = mine[np.argsort(mine["start"], kind="stable")][-MAX_ANALYSED:]
    dev = int(np.bincount(mine["dev"].astype(np.intp)).argmax())
    role = mine["role"]
    start = mine["start"].astype(np.int64)
    end = np.maximum(mine["end"].astype(np.int64), start)
    # windows: a host idle gap (previous call's end to this call's start) longer than WINDOW_GAP_NS
    idle = start[1:] - np.maximum.accumulate(end)[:-1]
    window = np.r_[0, np.cumsum(idle > WINDOW_GAP_NS)]
    is_launch = role == ApiRole.LAUNCH
    is_graph = role == ApiRole.GRAPH_LAUNCH
    launched = np.cumsum(is_launch | is_graph)  # calls that queue GPU work, up to and including each record
    sync_idx = np.flatnonzero(role == ApiRole.SYNC)
    # a wait starts where work was queued since the previous wait's last record (or a window begins)
    new_wait = np.ones(len(sync_idx), dtype=bool)
    if len(sync_idx) > 1:
        new_wait[1:] = (launched[sync_idx[1:]] != launched[sync_idx[:-1]]) | (
            window[sync_idx[1:]] != window[sync_idx[:-1]])
    group = np.cumsum(new_wait) - 1
    n_waits = int(new_wait.sum())
    period = match = step_s = launch_s = wait_s = k_max = None
    n_steps = 0
    spans: tuple[tuple[int, int], ...] = ()
    if n_waits >= 2:
        first = sync_idx[new_wait]  # each wait's first record: when it returns, nothing is queued
        last = np.zeros(n_waits, dtype=np.int64)
        np.maximum.at(last, group, sync_idx)  # and its last
        # Times of the first record only: a wait's later records (a copy after a synchronize, with host
        # work between) are no kernel's time.
        w_start, w_end = start[first], end[first]
        # step k: from the end of wait k to the end of wait k + 1, in one window
        last0, first1 = last[:-1], first[1:]
        same_window = window[last0] == window[first1]
        launches_cum = np.cumsum(is_launch)
        graphs_cum = np.cumsum(is_graph)
        n = launches_cum[first1] - launches_cum[last0]
        graphs = graphs_cum[first1] - graphs_cum[last0]
        ok = same_window & (n > 0)
        found = _steady(n[ok], window[first1][ok], min_steps=min_steps, min_match=min_match)
        if found is not None:
            period, match, first_ok = found
            chosen = np.zeros(len(n), dtype=bool)
            at = np.flatnonzero(ok)[first_ok:]
            chosen[at] = n[at] == period
            n_steps = int(chosen.sum())
            launch_idx = np.flatnonzero(is_launch)
            first_launch = launch_idx[np.searchsorted(launch_idx, last0[chosen] + 1)]
            last_launch = launch_idx[np.searchsorted(launch_idx, first1[chosen]) - 1]
            e0, s1, e1 = w_end[:-1][chosen], w_start[1:][chosen], w_end[1:][chosen]
            step_s = float((e1 - e0).mean()) / 1e9
            launch_s = float((end[last_launch] - start[first_launch]).mean()) / 1e9
            wait_s = float((e1 - s1).mean()) / 1e9
            plain = graphs[chosen] == 0  # a step that replays a graph runs kernels no launch counts
            if plain.any():
                k_max = float((e1 - start[first_launch])[plain].mean()) / period / 1e9
            win = window[first1[chosen]]
            spans = tuple((int(e0[win == w].min()), int(e1[win == w].max())) for w in np.unique(win).tolist())
    return LaunchStats(dev=dev, tid=tid, launches=int(is_launch.sum()), graph_launches=int(is_graph.sum()),
                       waits=n_waits, windows=int(window[-1]) + 1, period=period, steps=n_steps, match_ratio=match,
                       step_seconds=step_s, launch_seconds=launch_s, wait_seconds=wait_s, kernel_seconds_max=k_max,
                       spans=spans)
