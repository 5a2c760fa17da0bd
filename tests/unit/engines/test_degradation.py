from __future__ import annotations

from engine_support import GIB, dev, proc, snap
from gpufootprint.config import BudgetsConfig, DegradationConfig
from gpufootprint.engines.budgets import BudgetTracker
from gpufootprint.engines.degradation import DegradationTracker
from gpufootprint.snapshot import GpuState


def gpu(util: float | None, total: int | None = 100 * GIB) -> tuple[GpuState, ...]:
    return (GpuState(0, "NVIDIA H200", total_bytes=total, utilization_ratio=util),)


def run(tr: DegradationTracker, samples: list[tuple[float, float | None]], *procs):  # type: ignore[no-untyped-def]
    out = ()
    for t, u in samples:
        out = tr.evaluate(snap(t, *procs, gpus=gpu(u)))
    return out


def test_low_utilisation_for_five_minutes_suggests_a_smaller_gpu() -> None:
    tr = DegradationTracker(DegradationConfig())
    p = proc(1, dev(0, GIB))
    assert run(tr, [(float(t), 0.1) for t in range(0, 299, 10)], p) == ()  # 290 s: not yet
    (a,) = run(tr, [(300.0, 0.2)], p)
    assert (a.gpu, a.pid, a.advice) == (0, 1, "smaller_gpu") and "at most 20%" in a.reason


def test_one_busy_sample_or_an_unknown_one_restarts_the_count() -> None:
    tr = DegradationTracker(DegradationConfig())
    p = proc(1, dev(0, GIB))
    assert run(tr, [(float(t), 0.1 if t != 150 else 0.35) for t in range(0, 301, 10)], p) == ()
    tr = DegradationTracker(DegradationConfig())
    assert run(tr, [(float(t), 0.1 if t != 150 else None) for t in range(0, 301, 10)], p) == ()
    assert run(tr, [(float(t), 0.1) for t in range(310, 460, 10)], p) == ()  # 150 s since the gap: still no
    assert len(run(tr, [(460.0, 0.1)], p)) == 1  # 300 s after the unknown sample


def test_unknown_utilisation_gives_no_advice_and_idle_gpu_with_no_process_neither() -> None:
    tr = DegradationTracker(DegradationConfig())
    assert run(tr, [(float(t), None) for t in range(0, 700, 10)], proc(1, dev(0, GIB))) == ()
    assert run(DegradationTracker(DegradationConfig()), [(float(t), 0.0) for t in range(0, 700, 10)]) == ()


def test_requested_memory_above_80_percent_of_the_gpu_suggests_fp16() -> None:
    tr = DegradationTracker(DegradationConfig())
    (a,) = tr.evaluate(snap(0.0, proc(1, dev(0, 10 * GIB, peak=81 * GIB)), gpus=gpu(None)))
    assert (a.pid, a.advice) == (1, "fp16_gradient_checkpointing")
    assert tr.evaluate(snap(1.0, proc(1, dev(0, 10 * GIB, peak=80 * GIB)), gpus=gpu(None))) == ()  # not above
    assert tr.evaluate(snap(2.0, proc(1, dev(0, 10 * GIB, peak=90 * GIB)), gpus=gpu(None, total=None))) == ()


def test_budget_is_the_quota_when_one_covers_the_process() -> None:
    bt = BudgetTracker(BudgetsConfig(rules=[{"scope": "pod", "name": "p", "bytes": 10 * GIB}]))
    tr = DegradationTracker(DegradationConfig(memory_quota_ratio=0.8))
    procs = (proc(1, dev(0, GIB, peak=5 * GIB), info={"pod": "p"}),
             proc(2, dev(0, GIB, peak=4 * GIB), info={"pod": "p"}))
    s = snap(0.0, *procs, gpus=gpu(None))
    budgets, _ = bt.evaluate(s)
    advice = tr.evaluate(s, budgets)
    assert sorted((a.pid, a.advice) for a in advice) == [(1, "fp16_gradient_checkpointing"),
                                                         (2, "fp16_gradient_checkpointing")]
    assert "pod p requested 9663676416 B" in advice[0].reason


def test_zero_budget_quota_advises_any_process_that_asked_for_memory() -> None:
    bt = BudgetTracker(BudgetsConfig(rules=[{"scope": "process", "name": "*", "bytes": 0}]))
    tr = DegradationTracker(DegradationConfig())
    s = snap(0.0, proc(1, dev(0, 0, peak=1)), proc(2, dev(0, 0, peak=0)))
    assert [(a.pid, a.advice) for a in tr.evaluate(s, bt.evaluate(s)[0])] == [(1, "fp16_gradient_checkpointing")]
