"""The daemon's per-batch cost on a full node, in one process, without sockets.

  python bench/fullnode_cost.py [--probes 256] [--devices-per-probe 8] [--rate 32000] [--seconds 2]
                                [--profile out.pstats]

What ``bench/load.py`` puts through a real daemon, fed straight into the daemon's own
``Pipeline`` and ``FeatureHub`` at the default configuration: every probe flushes every 100 ms a
batch of allocation/release pairs spread over its GPUs, then a watermark; every ``daemon.tick_ms``
the snapshot is built as the ingest loop builds it. Time is simulated (``--seconds`` of it), so the
figure is CPU time per simulated second: below 1.0 the daemon's ingest thread keeps up on one core.
Reports CPU-seconds spent in batches+watermarks and in snapshots (with the leak engine after each, as the
daemon runs it; ``--no-leaks`` without), and records per CPU-second. ``--live N``: each process also holds N
allocations throughout, which the live tables the leak engine reads are built from.

What the daemon keeps grows for ``footprint.window_peak_seconds`` (60 s): a run shorter than that measures a
node that has not filled its windows. ``--seconds 70`` (with ``--probes 64 --devices-per-probe 1`` to stay
within minutes) is what found the window's peak walking 6,000 frames a device at every snapshot (2026-12-06).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import sys
import time
from pathlib import Path

import numpy as np

# --src: the package of another revision (a ``git worktree add`` of it), for a side-by-side run.
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else str(Path(__file__).resolve().parents[1] / "daemon")
sys.path.insert(0, _SRC)

from gpufootprint.config import Config  # noqa: E402
from gpufootprint.ingest import tick as ticks  # noqa: E402
try:
    from gpufootprint.ingest.server import COALESCE_S  # noqa: E402
except ImportError:  # a revision before busy mode
    COALESCE_S = 0.0
from gpufootprint.pipeline import Pipeline  # noqa: E402
from gpufootprint.records import MEMORY_DTYPE, MemoryKind, MemoryOp, RecordKind  # noqa: E402
try:
    from gpufootprint.hub import FeatureHub  # noqa: E402
except ImportError:  # a revision from before the hub left sampler/
    from gpufootprint.sampler.hub import FeatureHub  # type: ignore[no-redef]  # noqa: E402

FLUSH_NS = 100_000_000


def run(probes: int, devices: int, gpus: int, rate: float, seconds: float,
        prof: cProfile.Profile | None, flush_ns: int = FLUSH_NS, busy: bool = False,
        oom: bool = True, leaks: bool = True, live: int = 0) -> dict[str, float]:
    config = Config()
    clock = [0.0]
    pipeline = Pipeline(config.footprint, hub=FeatureHub(config.features, config.sampler),
                        monotonic=lambda: clock[0])
    if oom and config.oom.enabled:
        # The OOM capture's tap, as the daemon attaches it (app.py): it keeps each process's applied records.
        from gpufootprint.oom.manager import OomManager
        pipeline.hub.taps.append(OomManager(config.oom, pipeline, monotonic=lambda: clock[0]).on_records)
    tracker = None
    if leaks and config.leaks.enabled:
        # The leak engine as the daemon runs it after each snapshot (app.py): live tables in the snapshot, built
        # for the devices the engine asks for where the revision can (before 2026-12-07: for every device).
        from gpufootprint.engines.leaks import LeakTracker
        tracker = LeakTracker(config.leaks)
        pipeline.snapshot_live_tables = True
        if hasattr(pipeline, "live_table_wanted"):
            pipeline.live_table_wanted = tracker.wants_table
    if busy:  # what the ingest loop does while it is busy: watermarks wait, the snapshot is rebuilt less often
        pipeline.coalesce_s = COALESCE_S
    tick_ns = config.daemon.tick_ms * 1_000_000
    per_batch = max(2, round(rate / probes * flush_ns / 1e9 / 2) * 2)
    pairs = per_batch // 2
    t0 = 1_700_000_000 * 10**9
    batches: list[np.ndarray] = []
    for i in range(probes):
        recs = np.zeros(per_batch, MEMORY_DTYPE)
        pair_dev = (i + np.arange(pairs) % max(1, devices)) % gpus
        recs["pid"], recs["mk"], recs["bytes"] = 10_000 + i, MemoryKind.DEVICE, 2 << 20
        recs["dev"][0::2], recs["dev"][1::2] = pair_dev, pair_dev
        recs["op"][0::2], recs["op"][1::2] = MemoryOp.ALLOCATION, MemoryOp.RELEASE
        pipeline.process(10_000 + i, "probe").watermarked = True
        batches.append(recs)
        if live:  # what each process holds throughout (weights, a framework's tensors): never released
            held = np.zeros(live, MEMORY_DTYPE)
            held["pid"], held["mk"], held["bytes"], held["op"] = 10_000 + i, MemoryKind.DEVICE, 4096, MemoryOp.ALLOCATION
            held["dev"] = (i + np.arange(live) % max(1, devices)) % gpus
            held["addr"] = 0x1_0000_0000 + np.arange(live, dtype=np.uint64) * 4096
            held["ts"] = t0 - 10**10 + np.arange(live, dtype=np.uint64)
            pipeline.submit(RecordKind.MEMORY, held)
            pipeline.advance(10_000 + i, t0 - 10**9)  # before the first flush
    apply_s = snap_s = 0.0
    snapshots = 0
    records = 0
    flushes = int(seconds * 1e9 / flush_ns)
    next_tick = t0
    next_snapshot = t0
    for k in range(flushes):
        start = t0 + k * flush_ns
        for i, recs in enumerate(batches):
            # probes spread over the flush period, as in bench/load.py
            now = start + (i % 10) * flush_ns // 10
            last = now - flush_ns
            recs["addr"][0::2] = recs["addr"][1::2] = 0x7F00_0000_0000 + (
                (np.arange(pairs) + k * pairs) % 4096) * (2 << 20)
            recs["ts"] = last + 1 + (np.arange(per_batch, dtype=np.uint64) * (flush_ns - 1)) // per_batch
            clock[0] = (now - t0) / 1e9
            fresh = recs.copy()  # the batch a frame decodes to: not the daemon's cost (numpy copies records slowly)
            c0 = time.process_time()
            if prof is not None:
                prof.enable()
            pipeline.submit(RecordKind.MEMORY, fresh)
            pipeline.watermark(10_000 + i, now)
            if prof is not None:
                prof.disable()
            apply_s += time.process_time() - c0
            records += per_batch
            if now >= next_tick:
                next_tick = now + tick_ns
                c0 = time.process_time()
                if prof is not None:
                    prof.enable()
                if hasattr(pipeline, "apply_due"):
                    pipeline.apply_due()
                if prof is not None:
                    prof.disable()
                apply_s += time.process_time() - c0
                if now < next_snapshot:
                    continue
                next_snapshot = now + (int(COALESCE_S * 1e9) if busy else tick_ns)
                c0 = time.process_time()
                if prof is not None:
                    prof.enable()
                snapshot = ticks.pipeline_snapshot(pipeline, now / 1e9, lambda pid, exc: None)
                if tracker is not None:
                    tracker.evaluate(snapshot)
                if prof is not None:
                    prof.disable()
                snap_s += time.process_time() - c0
                snapshots += 1
    if hasattr(pipeline, "apply_due"):
        pipeline.apply_due(every=True)
    assert pipeline.late_records == 0, pipeline.late_records
    return {"probes": probes, "devices_per_probe": devices, "records": records, "simulated_s": seconds,
            "apply_cpu_s": round(apply_s, 3), "snapshot_cpu_s": round(snap_s, 3),
            "cores_needed": round((apply_s + snap_s) / seconds, 3),
            "records_per_apply_cpu_s": round(records / apply_s),
            "us_per_batch": round(1e6 * apply_s / (flushes * probes), 1),
            "snapshots": snapshots, "ms_per_snapshot": round(1e3 * snap_s / max(1, snapshots), 2), "busy": busy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", type=int, default=256)
    ap.add_argument("--devices-per-probe", type=int, default=8)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rate", type=float, default=32000.0)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--flush-ms", type=float, default=100.0, help="each probe's flush period")
    ap.add_argument("--busy", action="store_true",
                    help="as the ingest loop runs while busy: watermarks wait up to COALESCE_S, snapshots that often")
    ap.add_argument("--no-oom", action="store_true",
                    help="without the OOM capture's tap (the daemon has it unless oom.enabled is false)")
    ap.add_argument("--no-leaks", action="store_true",
                    help="without the leak engine and the live tables it reads (the daemon has both unless "
                         "leaks.enabled is false)")
    ap.add_argument("--live", type=int, default=0, help="allocations each process holds throughout (default 0)")
    ap.add_argument("--profile")
    ap.add_argument("--src", help="the daemon/ folder of the revision to measure (default: this tree's)")
    args = ap.parse_args()
    prof = cProfile.Profile() if args.profile else None
    res = run(args.probes, args.devices_per_probe, args.gpus, args.rate, args.seconds, prof, int(args.flush_ms * 1e6), args.busy,
              not args.no_oom, not args.no_leaks, args.live)
    res["src"] = _SRC
    print(json.dumps(res))
    if prof is not None:
        prof.dump_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
