from __future__ import annotations

import numpy as np
import pytest
from gpufootprint.config import FootprintConfig
from gpufootprint.pipeline import KernelRetention, Pipeline
from gpufootprint.records import KERNEL_DTYPE, RecordKind


def kern(n: int, t0: int = 1_000_000_000, pid: int = 1) -> np.ndarray:
    r = np.zeros(n, KERNEL_DTYPE)
    r["start"] = t0 + np.arange(n) * 1000
    r["end"] = r["start"] + 500
    r["pid"] = pid
    r["corr"] = np.arange(n)
    return r


def test_retention_keeps_the_newest_records_within_the_bound() -> None:
    kr = KernelRetention(100)
    for i in range(10):
        kr.add(kern(37, t0=i * 10**9)[:])
        arr = kr.array()
        assert len(arr) == min(100, 37 * (i + 1))
        assert not arr.flags.writeable
    assert arr["start"][-1] == 9 * 10**9 + 36 * 1000  # the newest is kept
    assert kr.array() is arr  # unchanged: no new join
    kr.add(kern(500))
    assert len(kr.array()) == 100 and kr.array()["corr"][0] == 400


def test_pipeline_retains_kernels_only_when_asked() -> None:
    off = Pipeline(FootprintConfig(reorder_window_ms=0))
    off.submit(RecordKind.KERNEL, kern(10))
    off.finish(1)
    assert off.snapshot(0.0).processes[0].recent_kernels is None
    on = Pipeline(FootprintConfig(reorder_window_ms=0), kernel_retention=8)
    on.submit(RecordKind.KERNEL, kern(10))
    on.finish(1)
    p = on.snapshot(0.0).processes[0]
    assert p.recent_kernels is not None and len(p.recent_kernels) == 8
    assert p.devices[0].kernel_count == 10  # the counters still see everything
    with pytest.raises(ValueError):
        p.recent_kernels["start"][0] = 0  # snapshots are immutable


def test_live_tables_appear_in_snapshots_only_when_asked() -> None:
    from gpufootprint.records import MEMORY_DTYPE

    m = np.zeros(2, MEMORY_DTYPE)
    m["ts"], m["op"], m["addr"], m["bytes"], m["mk"], m["pid"] = [5, 6], 1, [16, 32], [100, 200], 3, 1
    p = Pipeline(FootprintConfig(reorder_window_ms=0))
    p.submit(RecordKind.MEMORY, m)
    p.finish(1)
    assert p.snapshot(0.0).processes[0].devices[0].live_table is None
    p.snapshot_live_tables = True
    t = p.snapshot(0.0).processes[0].devices[0].live_table
    assert t is not None and t["ts"].tolist() == [5, 6] and t["bytes"].tolist() == [100, 200]


def test_live_table_is_rebuilt_only_when_the_table_changed() -> None:
    from gpufootprint.records import MEMORY_DTYPE

    def mem(ts: int, op: int, addr: int) -> np.ndarray:
        m = np.zeros(1, MEMORY_DTYPE)
        m["ts"], m["op"], m["addr"], m["bytes"], m["mk"], m["pid"] = ts, op, addr, 64, 3, 1
        return m

    p = Pipeline(FootprintConfig(reorder_window_ms=0))
    p.snapshot_live_tables = True
    p.submit(RecordKind.MEMORY, mem(10, 1, 16))
    p.advance(1, 10)
    a = p.snapshot(0.0).processes[0].devices[0].live_table
    assert p.snapshot(0.0).processes[0].devices[0].live_table is a  # no change: the same array
    p.submit(RecordKind.MEMORY, mem(20, 2, 16))
    p.advance(1, 20)
    b = p.snapshot(0.0).processes[0].devices[0].live_table
    assert b is not a and len(b) == 0 and len(a) == 1
    p.submit(RecordKind.MEMORY, mem(30, 1, 32))
    p.advance(1, 30)
    p.process_exited(1, 40)  # the driver freed it all
    assert len(p.snapshot(0.0).processes[0].devices[0].live_table) == 0
