from __future__ import annotations

import pytest
from engine_support import DATA, GIB, MIB, dev, proc, replay_snapshots, snap
from gpufootprint.config import CostConfig
from gpufootprint.engines.cost import CostLedger
from gpufootprint.snapshot import GpuState

PRICE = 3.80  # the example H200 price in the default table


def gpus(u0: float | None = None, u1: float | None = None) -> tuple[GpuState, ...]:
    return (GpuState(0, "NVIDIA H200", total_bytes=140 * GIB, utilization_ratio=u0),
            GpuState(1, "NVIDIA H200", total_bytes=140 * GIB, utilization_ratio=u1))


def reconcile(ledger: CostLedger, wall: float) -> None:
    totals = ledger.totals()
    for g in totals.gpus:
        expected = g.dollars_per_hour * wall / 3600  # type: ignore[operator]
        t = sum(p.time_dollars for p in totals.processes if p.dev == g.gpu)
        m = sum(p.memory_dollars for p in totals.processes if p.dev == g.gpu)
        assert g.wall_seconds == pytest.approx(wall, rel=1e-12)
        assert t + g.idle_dollars == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert m + g.unallocated_memory_dollars == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert t == pytest.approx(g.attributed_time_dollars, rel=1e-9, abs=1e-12)


def test_costs_reconcile_per_gpu_over_a_varied_hour() -> None:
    # GIVEN two GPUs for an hour sampled every 10 s: utilisation known on GPU 0 and unknown on GPU 1,
    # processes starting, sharing, one exiting mid-window, kernel time known in some intervals
    ledger = CostLedger(CostConfig())
    for i in range(361):
        t = 1000.0 + 10 * i
        ps = [proc(1, dev(0, 40 * GIB, kernel_seconds=0.5 * i), dev(1, 10 * GIB), info={"pod": "a"})]
        if 60 <= i < 200:
            ps.append(proc(2, dev(0, 20 * GIB, kernel_seconds=0.1 * i, pool_reserved=GIB, pool_used=0)))
        if i >= 200:
            ps.append(proc(2, dev(0, 0), exited=True))
        if i % 7:
            ps.append(proc(3, dev(1, 70 * GIB), source="nvml"))
        ledger.observe(snap(t, *ps, gpus=gpus(u0=(i % 10) / 10)))
    reconcile(ledger, 3600.0)
    totals = ledger.totals()
    by = {(p.pid, p.dev): p for p in totals.processes}
    # the exited process stopped accruing but its counters stay while it is in the snapshot
    assert by[(2, 0)].time_dollars > 0 and by[(2, 0)].unused_memory_dollars > 0
    g0, g1 = totals.gpus
    assert 0 < g0.idle_seconds < 3600 and g0.idle_seconds == pytest.approx(0.55 * 3600, rel=0.02)
    assert g1.idle_seconds == 0.0  # utilisation unknown and pid 1 always holds memory there
    # memory basis on GPU 1: pid 3 held 70 of 140 GiB in 6 of every 7 intervals (it flapped, NVML-only)
    assert by[(3, 1)].memory_dollars == pytest.approx(PRICE * 0.5 * 6 / 7, rel=0.02)
    # kernel-time share: pid 1 ran 5x pid 2's kernel time while both were there
    assert by[(1, 0)].time_dollars > 4 * by[(2, 0)].time_dollars
    # a process gone from snapshots longer than forget_after_seconds loses its series
    ledger.observe(snap(1000.0 + 3600 + 601, gpus=gpus()))
    assert ledger.totals().processes == ()
    assert totals.by_pod()[(None, "a")][0] == pytest.approx(by[(1, 0)].time_dollars + by[(1, 1)].time_dollars)


def test_memory_basis_is_bytes_over_the_gpu_size_and_unused_memory_is_slack_plus_headroom() -> None:
    ledger = CostLedger(CostConfig(max_interval_seconds=3600))
    info = {"torch": {"reserved": {"0": 30 * GIB}, "allocated": {"0": 20 * GIB}}}
    p = proc(1, dev(0, 35 * GIB, pool_reserved=4 * GIB, pool_used=3 * GIB), info=info)
    ledger.observe(snap(0.0, p, gpus=gpus()[:1]))
    (pc,) = ledger.observe(snap(3600.0, p, gpus=gpus()[:1])).processes
    assert pc.memory_dollars == pytest.approx(PRICE * 35 / 140)
    assert pc.unused_memory_dollars == pytest.approx(PRICE * 11 / 140)  # 10 GiB slack + 1 GiB pool headroom
    assert pc.time_dollars == pytest.approx(PRICE)  # utilisation unknown: the holder pays all of it


def test_unpriced_gpu_accrues_nothing_and_long_gaps_are_not_accrued() -> None:
    ledger = CostLedger(CostConfig(max_interval_seconds=60))
    p = proc(1, dev(0, GIB))
    ledger.observe(snap(0.0, p))  # no model known, no default model: unpriced
    t = ledger.observe(snap(10.0, p))
    assert t.processes == () and t.gpus[0].dollars_per_hour is None and t.gpus[0].wall_seconds == 0
    ledger = CostLedger(CostConfig(default_model="H100", max_interval_seconds=60))
    ledger.observe(snap(0.0, p))
    ledger.observe(snap(30.0, p))
    t = ledger.observe(snap(1000.0, p))  # the daemon stalled: this gap is skipped
    assert t.gpus[0].wall_seconds == 30.0 and t.gpus[0].dollars_per_hour == 2.90


def test_no_process_means_the_whole_gpu_is_idle() -> None:
    ledger = CostLedger(CostConfig())
    for t in (0.0, 10.0, 20.0):
        ledger.observe(snap(t, gpus=gpus(0.5)[:1]))
    (g,) = ledger.totals().gpus
    assert g.idle_seconds == 20.0 and g.idle_dollars == pytest.approx(PRICE * 20 / 3600)
    reconcile(ledger, 20.0)


def test_costs_reconcile_on_a_replayed_real_trace() -> None:
    ledger = CostLedger(CostConfig(default_model="H200", max_interval_seconds=3600))
    snaps = list(replay_snapshots(DATA / "synth_leak.gfp.gz"))
    for s in snaps:
        ledger.observe(s)
    wall = snaps[-1].taken_at - snaps[0].taken_at
    reconcile(ledger, wall)
    procs = ledger.totals().processes
    assert {p.pid for p in procs} == {5151, 5252}
    # memory basis follows the bytes held: 5252 holds ~512 MiB, 5151 grows from 64 MiB to ~1.2 GiB
    by = {p.pid: p for p in procs}
    assert by[5252].memory_dollars == pytest.approx(PRICE * wall / 3600 * (512 * MIB) / 150_754_820_096, rel=0.05)
    assert by[5151].time_dollars == pytest.approx(by[5252].time_dollars, rel=0.01)  # equal split, no kernels


def test_allocator_slack_from_the_probe_heartbeat_is_priced_as_unused_memory() -> None:
    # GIVEN a real pipeline: 2 GiB of device memory, and the probe's heartbeat says PyTorch reserved
    # 2 GiB of which 1.2 GiB is allocated (800 MiB of slack)
    import numpy as np
    from gpufootprint.config import FootprintConfig
    from gpufootprint.pipeline import Pipeline
    from gpufootprint.records import MEMORY_DTYPE, RecordKind

    pipeline = Pipeline(FootprintConfig())
    pipeline.process(7, "probe")
    rec = np.zeros(1, MEMORY_DTYPE)
    rec["ts"], rec["op"], rec["mk"], rec["addr"], rec["bytes"], rec["pid"] = 10**9, 1, 3, 0x1000, 2 * GIB, 7
    pipeline.submit(RecordKind.MEMORY, rec)
    pipeline.advance(7, 2 * 10**9)
    pipeline.note_torch(7, {"allocated": {"0": 2 * GIB - 800 * MIB}, "reserved": {"0": 2 * GIB}})
    ledger = CostLedger(CostConfig(max_interval_seconds=3600))
    import dataclasses

    ledger.observe(dataclasses.replace(pipeline.snapshot(wall_time=0.0), gpus=gpus()[:1]))
    (pc,) = ledger.observe(dataclasses.replace(pipeline.snapshot(wall_time=3600.0), gpus=gpus()[:1])).processes
    # THEN the slack reaches the cost engine: 800 MiB of 140 GiB for an hour
    assert pc.unused_memory_dollars == pytest.approx(PRICE * (800 * MIB) / (140 * GIB))


def test_a_replayed_trace_is_priced_as_the_gpu_it_was_recorded_on() -> None:
    # no NVML, no cost.default_model: the trace header's "NVIDIA H200" prices it
    for name in ("h200_caching.jsonl.gz", "h200_probe_expandable.gfp.gz"):
        ledger = CostLedger(CostConfig(max_interval_seconds=3600))
        snaps = list(replay_snapshots(DATA / name))
        for s in snaps:
            ledger.observe(s)
        (g,) = ledger.totals().gpus
        assert (g.model, g.dollars_per_hour) == ("NVIDIA H200", PRICE), name
        if name.endswith(".gfp.gz"):  # the probe's recording has watermarks: snapshots over time
            assert len(snaps) > 10 and sum(p.memory_dollars for p in ledger.totals().processes) > 0
        reconcile(ledger, g.wall_seconds)  # from the first snapshot that knew the GPU (no daemon start here)


def test_wall_time_runs_from_the_daemon_start_even_while_no_process_is_on_the_gpu() -> None:
    # GIVEN a daemon started at t=0 without NVML: the GPU is first seen with a process at t=100,
    # the process leaves at t=300 and is forgotten; snapshots continue to t=500
    ledger = CostLedger(CostConfig(default_model="H200"), started_at=0.0)
    for t in range(0, 501, 10):
        ps = [proc(1, dev(0, 10 * GIB))] if 100 <= t < 300 else []
        ledger.observe(snap(float(t), *ps))
    (g,) = ledger.totals().gpus
    # THEN the GPU's wall time is the daemon's, idle outside the process's 200 s, and it reconciles
    assert g.wall_seconds == pytest.approx(500.0)
    assert g.idle_seconds == pytest.approx(300.0)
    reconcile(ledger, 500.0)
