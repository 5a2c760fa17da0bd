"""Memory each bounded item costs inside the daemon (docs/reliability.md, the memory-bound table).

Measured with tracemalloc around a real ``Pipeline`` (the daemon's, with the default
configuration's feature hub): a live allocation, a (process, device) table carrying 20 s of dense
records of four kinds (1,000 records/s each), and a retained KERNEL record.

    python bench/unit_costs.py
"""

from __future__ import annotations

import gc
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine  # noqa: E402

from gpufootprint.configload import load_config  # noqa: E402
from gpufootprint.pipeline import Pipeline  # noqa: E402
from gpufootprint.records import KERNEL_DTYPE, MEMCPY_DTYPE, MEMORY_DTYPE, UNIFIED_MEMORY_DTYPE, RecordKind  # noqa: E402
from gpufootprint.hub import FeatureHub  # noqa: E402


def pipeline(retention: int = 0) -> Pipeline:
    cfg = load_config(env={})
    return Pipeline(cfg.footprint, hub=FeatureHub(cfg.features, cfg.sampler), kernel_retention=retention)


def measured(fn) -> int:  # type: ignore[no-untyped-def]
    gc.collect()
    tracemalloc.start()
    keep = fn()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del keep
    return used


def live_allocations(n: int = 200_000) -> Pipeline:
    p = pipeline()
    t = time.time_ns()
    r = np.zeros(n, MEMORY_DTYPE)
    r["ts"], r["addr"], r["bytes"], r["pid"], r["op"], r["mk"] = t + np.arange(n), 0x100000 + np.arange(n) * 256, 4096, 5, 1, 3
    p.submit(RecordKind.MEMORY, r)
    p.advance(5, t + 10**9)
    p.snapshot()
    return p


def dense_tables(n_tables: int = 10, n: int = 20_000) -> Pipeline:
    p = pipeline()
    t = time.time_ns()
    for pid in range(1000, 1000 + n_tables):
        ts = t + np.arange(n, dtype=np.uint64) * 1_000_000
        r = np.zeros(n, MEMORY_DTYPE)
        r["ts"], r["bytes"], r["pid"], r["mk"] = ts, 4096, pid, 3
        r["op"] = np.where(np.arange(n) % 2 == 0, 1, 2)
        r["addr"] = 0x1000 + (np.arange(n) // 2) * 4096
        p.submit(RecordKind.MEMORY, r)
        k = np.zeros(n, KERNEL_DTYPE)
        k["start"], k["end"], k["pid"] = ts, ts + 1000, pid
        p.submit(RecordKind.KERNEL, k)
        c = np.zeros(n, MEMCPY_DTYPE)
        c["start"], c["end"], c["pid"], c["bytes"], c["ck"] = ts, ts + 1000, pid, 100, 1
        p.submit(RecordKind.MEMCPY, c)
        u = np.zeros(n, UNIFIED_MEMORY_DTYPE)
        u["start"], u["end"], u["pid"], u["value"], u["ck"] = ts, ts + 1000, pid, 4096, 1
        p.submit(RecordKind.UNIFIED_MEMORY, u)
        p.advance(pid, int(ts[-1]) + 1)
    p.snapshot()
    return p


def kernels(n: int = 200_000) -> Pipeline:
    p = pipeline(retention=n)
    k = np.zeros(n, KERNEL_DTYPE)
    k["start"] = time.time_ns() + np.arange(n)
    k["end"], k["pid"] = k["start"] + 10, 9
    p.submit(RecordKind.KERNEL, k)
    p.advance(9, int(k["start"][-1]) + 1)
    p.snapshot()
    return p


def main() -> int:
    base = measured(pipeline)
    print(f"live allocation: {(measured(live_allocations) - base) / 200_000:.0f} B each")
    print(f"(process, device) table, 20 s of dense records: {(measured(dense_tables) - base) / 10 / 2**20:.2f} MiB each")
    print(f"retained KERNEL record: {(measured(kernels) - base) / 200_000:.0f} B each")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
