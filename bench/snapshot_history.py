"""What a snapshot pays for each device's history (no GPU needed): the window's peak and the recent
migration windows, with the history full.

Every snapshot (ten a second; once a second while ingest is busy) reads, for every (process, GPU), its peak
over ``footprint.window_peak_seconds`` (60 s of 10 ms frames: up to 6,000) and its migration windows closed
in the last second (of up to 258 kept: ``features.keep_seconds`` 10 s of 50 ms). Both once built or walked
their whole history at each snapshot. This fills one device's history as a process that allocates in every
frame and migrates pages in every window would, then times each read and prints microseconds a call.

Usage: python bench/snapshot_history.py [--src DAEMON_DIR] [--calls N] [--repeat R]
  --src: the ``daemon/`` folder of the tree to measure (default: this one's), e.g. a ``git worktree`` of a base.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import timeit
from pathlib import Path

MS = 1_000_000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "daemon"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    import numpy as np
    from gpufootprint.features.frames import FrameBuilder
    from gpufootprint.footprint.peaks import FramePeaks

    peaks = FramePeaks(10 * MS, 60_000 * MS)
    rng = np.random.default_rng(1)
    for k in range(7_000):  # 70 s of frames, each with a few events: the 60 s window full
        ts = np.sort(k * 10 * MS + rng.integers(0, 10 * MS, 4)).astype(np.int64)
        peaks.add(ts, rng.integers(-(1 << 20), 1 << 20, 4).astype(np.int64))
    builder = FrameBuilder(1, 0, peaks, keep_ns=10_000 * MS, migration_ns=50 * MS, reuse_capacity=1024)
    for wid in range(1_400):  # 70 s of 50 ms windows with migrations, up to now: the 10 s history full
        builder._window(wid)[0] += 1
        builder._prune()
    now = 7_000 * 10 * MS
    recent = builder.recent_migration_windows(now)
    assert len(recent) == 20, f"{len(recent)} recent migration windows: the bench would time an empty read"
    cases = {
        f"window peak (60 s, {len(peaks.frames())} frames kept)": lambda: peaks.window_peak(now, 60_000 * MS),
        f"recent migration windows ({len(builder._windows)} kept)": lambda: builder.recent_migration_windows(now),
    }
    print(f"# {platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}; "
          f"src {args.src}")
    for name, call in cases.items():
        best = min(timeit.repeat(call, number=args.calls, repeat=args.repeat)) / args.calls
        print(f"{name}: {best * 1e6:.1f} us a call (best of {args.repeat} x {args.calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
