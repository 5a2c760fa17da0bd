"""The GPU's busy time over a launch window's steps, from NVML's per-process utilisation (pure).

A launch window (engines/launches.py) bounds the mean kernel duration from above only. Below, a
bound needs the time the GPU ran the process's kernels: NVML samples, per process, the share of
the driver's sample period in which one or more of its kernels ran (``nvmlDeviceGetProcessesUtilizationInfo``
or ``nvmlDeviceGetProcessUtilization``, polled by nvml/poller.py). Over the steps a window read, that
share times the step's wall time is the GPU's busy time per step; kernels that overlap count once,
so the busy time over the launch count is at most the mean kernel duration (kernels on several
streams only make the mean longer).

What makes it an estimate, not a bound: the driver's samples are integer percents of its own period
(about a sixth of a second), not aligned with the steps; a window shorter than a period is judged
from the periods around it; a period in which the process ran no kernel yields no sample at all (an
idle stretch is missing, not counted as zero); kernels other threads launched count as busy time.
So the advisor takes the share minus ``graph_advisor.busy_error`` (the error measured against kernel
records on the H200, docs/engines.md) as the lower bound, and no bound where no sample is near.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

#: Samples stamped up to this long after a span's end still describe it: the driver stamps a sample at
#: the end of its period, which can close after the window did.
SLACK_NS = 500_000_000


@dataclass(frozen=True, slots=True)
class BusyEstimate:
    ratio: float  # mean sampled share of time the process's kernels ran, over the spans
    samples: int


def samples_near(samples: Sequence[tuple[int, float]], spans: Sequence[tuple[int, int]],
                 slack_ns: int = SLACK_NS) -> list[tuple[int, float]]:
    """The samples stamped within a span (or ``slack_ns`` after its end), each once, in time order.
    ``samples`` are in time order (as NVML's poller keeps them, and abtest loads them).

    Asked at every snapshot (every 100 ms) for every process judged from launch windows: bisections per
    span, not a scan of every sample against every span (about 0.8 ms a process at 1,024 samples and 12
    windows, which a node of 256 processes could not pay ten times a second)."""
    ranges = sorted((bisect.bisect_left(samples, s, key=_time), bisect.bisect_right(samples, e + slack_ns, key=_time))
                    for s, e in spans)
    chosen: list[tuple[int, float]] = []
    done = 0  # samples before this index are taken already (overlapping spans)
    for lo, hi in ranges:
        chosen.extend(samples[max(lo, done):hi])
        done = max(done, hi)
    return chosen


def busy_over(samples: Sequence[tuple[int, float]], spans: Sequence[tuple[int, int]],
              slack_ns: int = SLACK_NS) -> BusyEstimate | None:
    """The mean of the samples near the spans (``samples_near``); None without any."""
    chosen = samples_near(samples, spans, slack_ns)
    if not chosen:
        return None
    return BusyEstimate(ratio=sum(r for _, r in chosen) / len(chosen), samples=len(chosen))


def _time(sample: tuple[int, float]) -> int:
    return sample[0]


def kernel_seconds_min(busy: BusyEstimate, step_seconds: float, launches_per_step: int, error: float) -> float:
    """The lower bound of the mean kernel duration: (share - error) of the step, over its launches."""
    return max(0.0, busy.ratio - error) * step_seconds / launches_per_step
