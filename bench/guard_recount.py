"""The ingest guard's recount at each tick, with many processes' records waiting (no GPU needed).

While the ingest loop is busy a probe's watermarks wait up to a second (``COALESCE_S``) to be applied
together, so at 500,000 records a second from 64 probes about a thousand chunks of records wait at any
tick; the guard recounts each process's live and waiting allocations at every tick (``Guard.recount``, ten
times a second). This builds ``--processes`` processes with ``--chunks`` waiting chunks of ``--records``
MEMORY records each (and no table), then times ``--ticks`` recounts and prints the CPU time of one. The tree
measured is this file's: for a side-by-side run copy it into the other tree.

Usage: python bench/guard_recount.py [--processes P] [--chunks C] [--records R] [--ticks T] [--rounds K]
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

from gpufootprint.config import DaemonConfig  # noqa: E402
from gpufootprint.ingest.validate import Guard, Limits  # noqa: E402
from gpufootprint.pipeline import ProcessState  # noqa: E402
from gpufootprint.records import MEMORY_DTYPE, MemoryOp, RecordKind  # noqa: E402


def one_round(processes: int, chunks: int, records: int, ticks: int) -> float:
    """CPU milliseconds of one recount."""
    procs: dict[int, ProcessState] = {}
    for pid in range(1, processes + 1):
        proc = ProcessState(pid=pid, source="probe")
        heap = []
        for c in range(chunks):
            recs = np.zeros(records, MEMORY_DTYPE)
            recs["op"][0::2], recs["op"][1::2] = MemoryOp.ALLOCATION, MemoryOp.RELEASE
            recs["pid"] = pid
            heap.append((c, c, recs, c))
        proc.pending[RecordKind.MEMORY] = heap
        proc.pending_records = chunks * records
        procs[pid] = proc
    guard = Guard(Limits.from_config(DaemonConfig()))
    guard.recount(procs)
    t = time.thread_time()
    for _ in range(ticks):
        guard.recount(procs)
    return (time.thread_time() - t) / ticks * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=15, help="waiting chunks a process (about a second of flushes)")
    ap.add_argument("--records", type=int, default=512)
    ap.add_argument("--ticks", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import gpufootprint

    print(f"{platform.node()} {platform.machine()} cpus={os.cpu_count()} python {platform.python_version()} numpy "
          f"{np.__version__}; gpufootprint from {Path(gpufootprint.__file__).parent}; {args.processes} processes x "
          f"{args.chunks} waiting chunks of {args.records} records")
    ms = [one_round(args.processes, args.chunks, args.records, args.ticks) for _ in range(args.rounds)]
    print(f"recount: median {statistics.median(ms):.3f} ms a tick (range {min(ms):.3f}-{max(ms):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
