"""What the engines cost per daemon tick (run: python bench/engines_tick.py).

Measures, side by side in one run, on this machine's CPU:
* building a snapshot with and without the live tables the leak engine reads,
  for N live allocations (unchanged since the last tick: cached; changed: rebuilt);
* ``Engines.step`` on that snapshot: with the kernel statistics cached (the
  common tick: no new kernel window) and cold (a new window of K kernels).
Medians of repeated runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gpufootprint.config import Config, FootprintConfig
from gpufootprint.engines.runner import Engines
from gpufootprint.pipeline import Pipeline
from gpufootprint.records import MEMORY_DTYPE, RecordKind
from synth_traces import kernel_stream


def median_ms(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def pipeline_with(n_live: int, n_kernels: int) -> Pipeline:
    p = Pipeline(FootprintConfig(reorder_window_ms=0), kernel_retention=max(1, n_kernels))
    m = np.zeros(n_live, MEMORY_DTYPE)
    m["ts"] = 10**18 + np.arange(n_live) * 1000
    m["op"], m["mk"], m["pid"], m["bytes"] = 1, 3, 1, 1 << 20
    m["addr"] = 0x7000_0000_0000 + np.arange(n_live, dtype=np.uint64) * (1 << 20)
    p.submit(RecordKind.MEMORY, m)
    rng = np.random.default_rng(1)
    ids = list(range(1, 41))
    steps = max(1, n_kernels // len(ids))
    k, _ = kernel_stream(rng, pid=1, stream=7, t0=10**18, steps=steps, ids=ids, dur_us=[300] * 40, gap_us=20,
                         step_gap_us=1000)
    p.submit(RecordKind.KERNEL, k)
    p.finish(1)
    return p


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    rows = []
    for n_live, n_kernels in ((1_000, 16_384), (10_000, 16_384), (100_000, 65_536)):
        p = pipeline_with(n_live, n_kernels)
        plain = median_ms(lambda: p.snapshot(1.0), args.reps)
        p.snapshot_live_tables = True
        with_tables = median_ms(lambda: p.snapshot(1.0), args.reps)  # table unchanged: cached

        def changed() -> None:
            p.processes[1].live_versions[0] += 1  # as after any MEMORY record: rebuilt
            p.snapshot(1.0)

        rebuilt = median_ms(changed, args.reps)
        snap = p.snapshot(1.0)
        eng = Engines(Config())
        eng.step(snap)
        cached = median_ms(lambda: eng.step(snap), args.reps)

        def cold() -> None:
            eng._stats.clear()  # a new kernel window: statistics recomputed
            eng.step(snap)

        cold_ms = median_ms(cold, max(3, args.reps // 3))
        rows.append({"live_allocations": n_live, "kernels": n_kernels, "snapshot_ms": plain,
                     "snapshot_with_live_tables_ms": with_tables, "snapshot_live_tables_rebuilt_ms": rebuilt, "engines_step_cached_ms": cached,
                     "engines_step_new_kernel_window_ms": cold_ms})
        print(f"live={n_live:>7} kernels={n_kernels:>6}  snapshot {plain:6.3f} ms  +live tables unchanged "
              f"{with_tables:6.3f} ms, rebuilt {rebuilt:7.3f} ms  engines.step {cached:6.3f} ms, "
              f"new kernel window {cold_ms:7.3f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
