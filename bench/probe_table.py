"""The probe's own live table at its watermarks under allocation churn: CPU per record (no GPU needed).

Under cudaMallocAsync a process writes about 57,000 MEMORY2 records a second; the probe queues the structs
of each forwarded CUPTI buffer (``LiveTable.add_raw``) and applies them at each watermark
(``LiveTable.advance``), which is stamped at the forced flush before the latest, so the records of the last
flush period wait for the next one. This feeds ``--watermarks`` periods of ``--buffers`` buffers of 512
records (allocation and release pairs over 256 addresses reused in every buffer, as
tests/integration/probe_child.py's stream writes them), advancing at each with the last ``--waiting``
share of the period left waiting, and prints the CPU time (``time.thread_time``) per record of the queueing
(``add_raw``, which copies each buffer's structs and may move the queue within its array) and of the
advances, and their sum. The tree measured is this file's: for a side-by-side run copy it into the other tree.

The table's totals, which the daemon asks for with every watermark, are timed apart (``totals``, a watermark), with
``--live`` allocations held through the run: before 2026-12-07 evening they were a walk of every live entry.

``--pair``: the advance pairs a watermark's structs by address in C (``gfp_pair``, the default since 2026-12-07
evening) or with numpy's sort by address and time (before).

Usage: python bench/probe_table.py [--watermarks W] [--buffers B] [--waiting F] [--rounds R] [--threads T] [--live N]
       [--pair c|numpy]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

import numpy as np  # noqa: E402

from gpufootprint.probe.livetable import LiveTable  # noqa: E402
from gpufootprint.probe.nativecallbacks import Pairer  # noqa: E402
from gpufootprint.wire import cupti_layout  # noqa: E402

PER_BUFFER = 512


def one_round(watermarks: int, buffers: int, waiting: float, threads: int = 1,
              live: int = 0, pair: str = "c") -> tuple[float, float, float]:
    """The CPU time per record, in microseconds, of queueing (``add_raw``) and of the advances, and of the table's
    totals a watermark (what the daemon asks for with each one), in microseconds.

    ``live``: allocations that stay live through the run (a model's weights and state; with PyTorch's cache off
    or cudaMallocAsync each tensor is one), applied before the first period.

    ``threads`` > 1: CUPTI's per-thread buffers, as several allocating threads give them: each group of
    ``threads`` buffers covers one stretch of time, its records interleaved (thread j's at j, j + threads, ...;
    addresses of their own), and each watermark falls in the middle of a group, so what waits is not the
    queue's tail but every other stretch of the group's buffers and the groups after."""
    buf = np.zeros(PER_BUFFER, cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2])
    buf["op"] = np.tile([1, 2], PER_BUFFER // 2)  # allocation, release
    buf["mk"] = 3  # device
    buf["bytes"] = 4096
    base_addr = 0x2_0000_0000 + np.repeat(np.arange(PER_BUFFER // 2), 2) * 4096
    table = LiveTable(pairer=Pairer() if pair == "c" else None)
    ts, cpu, queueing, n, totals = 1_700_000_000_000_000_000, 0.0, 0.0, 0, 0.0
    if live:
        held = np.zeros(live, cupti_layout.RAW_DTYPES[cupti_layout.MEMORY2])
        held["op"], held["mk"], held["bytes"] = 1, 3, 1 << 20
        held["address"] = 0x9_0000_0000 + np.arange(live) * (1 << 20)
        held["timestamp"] = ts - live + np.arange(live)
        table.add_raw(held, 1)
        table.advance(ts - 1)
    groups = max(1, buffers // threads)
    for _ in range(watermarks):
        for _ in range(groups):
            for j in range(threads):
                buf["address"] = base_addr + (j << 32)
                buf["timestamp"] = ts + j + threads * np.arange(PER_BUFFER)
                t = time.thread_time()
                table.add_raw(buf, 1)
                queueing += time.thread_time() - t
                n += PER_BUFFER
            ts += threads * PER_BUFFER
        cut = ts - int(waiting * groups) * threads * PER_BUFFER
        if threads > 1:
            cut -= threads * PER_BUFFER // 2 + 1  # mid-group: an allocation and its release on either side
        t = time.thread_time()
        table.advance(cut)
        cpu += time.thread_time() - t
        t = time.thread_time()
        table.totals()
        totals += time.thread_time() - t
    return queueing / n * 1e6, cpu / n * 1e6, totals / watermarks * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--watermarks", type=int, default=60)
    ap.add_argument("--buffers", type=int, default=110, help="buffers a watermark period (110: 56,320 records)")
    ap.add_argument("--waiting", type=float, default=0.5, help="share of a period's records left waiting")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="allocating threads whose CUPTI buffers interleave in time (1: records in time order)")
    ap.add_argument("--live", type=int, default=0, help="allocations that stay live through the run")
    ap.add_argument("--pair", choices=("c", "numpy"), default="c",
                    help="the advance's pairing by address: in C (the probe's default where its library loads, "
                         "since 2026-12-07 evening) or numpy's sort (before; native_pair off)")
    args = ap.parse_args()
    import gpufootprint

    print(f"{platform.node()} {platform.machine()} cpus={os.cpu_count()} python {platform.python_version()} numpy "
          f"{np.__version__}; gpufootprint from {Path(gpufootprint.__file__).parent}; {args.watermarks} watermarks of "
          f"{max(1, args.buffers // args.threads) * args.threads * PER_BUFFER} records, {args.waiting:g} of each left waiting, "
          f"{args.threads} thread(s), {args.live} allocations live, pairing in {args.pair}")
    runs = [one_round(args.watermarks, args.buffers, args.waiting, args.threads, args.live, args.pair)
            for _ in range(args.rounds)]
    for name, us in (("queueing (add_raw)", [r[0] for r in runs]), ("advance", [r[1] for r in runs]),
                     ("both", [r[0] + r[1] for r in runs])):
        print(f"{name:18s} median {statistics.median(us):.4f} us a record (range {min(us):.4f}-{max(us):.4f})")
    tot = [r[2] for r in runs]
    print(f"{'totals':18s} median {statistics.median(tot):.1f} us a watermark (range {min(tot):.1f}-{max(tot):.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
