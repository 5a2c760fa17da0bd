"""What the engines cost per daemon tick (run: python bench/engines_tick.py).

Measures, side by side in one run, on this machine's CPU:
* building a snapshot with and without the live tables the leak engine reads,
  for N live allocations (unchanged since the last tick: cached; changed: rebuilt);
* ``Engines.step`` on that snapshot: with the kernel statistics cached (the
  common tick: no new kernel window) and cold (a new window of K kernels);
* ``Engines.step`` on a node of P processes judged from launch windows (12 windows a process, as the
  back-off gives about two hours), each with NVML's 1,024 busy samples: the common tick, with the
  samples near each window's steps kept past the poller's three minutes.
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
from gpufootprint.records import API_DTYPE, KERNEL_DTYPE, MEMORY_DTYPE, ApiRole, RecordKind
from gpufootprint.snapshot import PipelineSnapshot
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


def launch_windows(pid: int, windows: int = 12, steps: int = 10, launches: int = 20) -> np.ndarray:
    """A process's retained launch-window calls: ``windows`` windows 600 s apart, each of ``steps`` steps of
    ``launches`` 5 us launches and a 20 us wait, 100 us of host work between steps."""
    rows = []
    for w in range(windows):
        t = 10**12 + w * 600 * 10**9
        for _ in range(steps):
            t += 100_000
            for _ in range(launches):
                rows.append((ApiRole.LAUNCH, t, t + 5_000))
                t += 5_000
            rows.append((ApiRole.SYNC, t, t + 20_000))
            t += 20_000
    api = np.zeros(len(rows), API_DTYPE)
    api["role"], api["start"], api["end"] = zip(*rows, strict=True)
    api["tid"], api["domain"], api["pid"] = 1, 5, pid
    return api


def launch_node(n_procs: int) -> PipelineSnapshot:
    """A snapshot of ``n_procs`` processes on one GPU, each judged from its launch windows, with 1,024 busy
    samples a process from NVML (the poller's limit), the newest of them after its last window."""
    from engine_support import dev, proc, snap, with_busy

    procs = [proc(pid, dev(0, 1), recent_kernels=np.zeros(0, KERNEL_DTYPE), recent_launches=launch_windows(pid))
             for pid in range(1, n_procs + 1)]
    last = 10**12 + 11 * 600 * 10**9
    busy = tuple((last - (1024 - i) * 166_000_000, 0.5) for i in range(1024))
    return with_busy(snap(1.0, *procs), dict.fromkeys(range(1, n_procs + 1), busy))


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
    for n_procs in (1, 64, 256):
        node = launch_node(n_procs)
        eng = Engines(Config())
        eng.step(node)  # the launch statistics computed once, as at a window's arrival
        step_ms = median_ms(lambda: eng.step(node), max(3, args.reps // 3))
        rows.append({"launch_window_processes": n_procs, "engines_step_ms": step_ms})
        print(f"processes judged from launch windows={n_procs:>4} (12 windows, 1,024 busy samples each)  "
              f"engines.step {step_ms:8.3f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
