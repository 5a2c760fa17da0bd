"""The daemon's check of one process against its probe's TOTALS (``Pipeline.verify``), which runs at every
watermark of every probed process (once a second each), for a process holding 2,000 / 20,000 live allocations on
one device. Prints the median of 7 x 200 checks in microseconds. ``--src``: the daemon/ folder of another revision
(a git worktree), for a side-by-side run.

Usage: python bench/verify_cost.py [--src DAEMON_DIR]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine  # noqa: E402  (puts this tree's daemon/ on the path: --src goes before it)
from _src import src_args  # noqa: E402

args = src_args(__doc__)

import numpy as np  # noqa: E402
import gpufootprint  # noqa: E402
from gpufootprint.config import FootprintConfig  # noqa: E402
from gpufootprint.pipeline import Pipeline  # noqa: E402
from gpufootprint.records import MEMORY_DTYPE, RecordKind  # noqa: E402


def one(live: int) -> float:
    pipeline = Pipeline(FootprintConfig(reorder_window_ms=0))
    recs = np.zeros(live, MEMORY_DTYPE)
    recs["ts"] = 1_000_000 + np.arange(live)
    recs["addr"] = 0x7F00_0000_0000 + np.arange(live) * (1 << 20)
    recs["bytes"], recs["op"], recs["mk"], recs["pid"] = 4096, 1, 3, 100
    pipeline.submit(RecordKind.MEMORY, recs)
    ts = int(recs["ts"][-1])
    pipeline.advance(100, ts)
    totals = {0: {3: (4096 * live, live)}}
    assert pipeline.verify(100, ts, totals) == "match"
    times = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(200):
            pipeline.verify(100, ts, totals)
        times.append((time.perf_counter() - t) / 200 * 1e6)
    return statistics.median(times)


print(f"{machine()}; gpufootprint from {Path(gpufootprint.__file__).parent}")
for live in (2_000, 20_000):
    print(f"{live:>6} live allocations: verify {one(live):.1f} us a check (median of 7 x 200)")
