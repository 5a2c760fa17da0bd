from __future__ import annotations

import math

from engine_support import DATA, GIB, MIB, dev, proc, replay_snapshots, snap
from gpufootprint.config import BudgetsConfig
from gpufootprint.configload import load_config
from gpufootprint.engines.budgets import BudgetTracker
from gpufootprint.snapshot import GpuState

H200 = (GpuState(0, "NVIDIA H200", total_bytes=140 * GIB),)


def tracker(*rules: dict, **kw) -> BudgetTracker:  # type: ignore[type-arg]
    return BudgetTracker(BudgetsConfig(rules=list(rules), **kw))


def test_process_budget_on_a_replayed_real_trace_matches_the_footprint() -> None:
    t = tracker({"scope": "process", "name": "*", "bytes": 512 * MIB})
    statuses = []
    for s in replay_snapshots(DATA / "h200_caching.jsonl.gz"):
        st, actions = t.evaluate(s)
        assert actions == ()
        statuses.append((s, st))
    s, (st,) = statuses[-1]
    p = s.processes[0]
    assert st.scope == "process" and st.name == str(p.pid)
    assert st.used_bytes == sum(d.device_bytes for d in p.devices)
    assert st.utilization_ratio == st.used_bytes / (512 * MIB)


def test_linear_growth_predicts_exhaustion_from_the_least_squares_slope() -> None:
    t = tracker({"scope": "process", "name": "7", "bytes": 10 * GIB}, min_trend_points=3)
    out = None
    for i in range(10):  # 100 MiB per second, from 1 GiB
        out, _ = t.evaluate(snap(100.0 + i, proc(7, dev(0, GIB + i * 100 * MIB))))
    (st,) = out  # type: ignore[misc]
    assert abs(st.slope_bytes_per_second - 100 * MIB) < 1e-3  # type: ignore[operator]
    expected = (10 * GIB - (GIB + 900 * MIB)) / (100 * MIB)
    assert abs(st.exhaustion_seconds - expected) < 1e-6  # type: ignore[operator]


def test_flat_or_shrinking_use_has_no_exhaustion_time() -> None:
    t = tracker({"scope": "process", "name": "7", "bytes": 10 * GIB}, min_trend_points=3)
    for i in range(5):
        (st,), _ = t.evaluate(snap(float(i), proc(7, dev(0, 5 * GIB - i * MIB))))
    assert st.exhaustion_seconds is None and st.utilization_ratio < 0.5  # type: ignore[operator]


def test_zero_budget_is_exceeded_by_any_use() -> None:
    t = tracker({"scope": "pod", "name": "web", "bytes": 0})
    (st,), _ = t.evaluate(snap(1.0, proc(1, dev(0, 0), info={"pod": "web"})))
    assert (st.utilization_ratio, st.exceeded, st.exhaustion_seconds) == (0.0, False, None)
    (st,), _ = t.evaluate(snap(2.0, proc(1, dev(0, 1), info={"pod": "web"})))
    assert st.utilization_ratio == math.inf and st.exceeded and st.exhaustion_seconds == 0.0


def test_fraction_budget_needs_the_gpu_size() -> None:
    rule = {"scope": "gpu", "name": "0", "fraction": 0.5}
    (st,), _ = tracker(rule).evaluate(snap(1.0, proc(1, dev(0, GIB))))
    assert st.budget_bytes is None and st.utilization_ratio is None and "unknown" in st.reasons[0]
    (st,), _ = tracker(rule).evaluate(snap(1.0, proc(1, dev(0, 7 * GIB)), gpus=H200))
    assert st.budget_bytes == 70 * GIB and abs(st.utilization_ratio - 0.1) < 1e-12  # type: ignore[operator]


def test_scopes_group_processes_and_exited_ones_do_not_count() -> None:
    t = tracker({"scope": "namespace", "name": "*", "bytes": 8 * GIB}, {"scope": "gpu", "name": "*", "bytes": GIB})
    s = snap(1.0, proc(1, dev(0, GIB), info={"namespace": "ml", "pod": "a"}),
             proc(2, dev(0, 2 * GIB), dev(1, GIB), info={"namespace": "ml", "pod": "b"}),
             proc(3, dev(1, 5 * GIB), info={"namespace": "ml"}, exited=True),
             proc(4, dev(1, GIB), info={"namespace": "batch"}))
    st, _ = t.evaluate(s)
    by = {(x.scope, x.name): x for x in st}
    assert by[("namespace", "ml")].used_bytes == 4 * GIB and by[("namespace", "ml")].pids == (1, 2)
    assert by[("namespace", "batch")].used_bytes == GIB
    assert by[("gpu", "0")].used_bytes == 3 * GIB and by[("gpu", "1")].used_bytes == 2 * GIB


def test_soft_action_respects_cooldown_and_goes_to_probes_only() -> None:
    t = tracker({"scope": "pod", "name": "p", "bytes": 10 * GIB, "soft_action": True, "soft_fraction": 0.8},
                action_cooldown_seconds=60)
    procs = (proc(1, dev(0, 5 * GIB), info={"pod": "p"}), proc(2, dev(0, 4 * GIB), info={"pod": "p"}, source="nvml"))
    _, a = t.evaluate(snap(0.0, *procs))
    assert [(x.pid, x.action, x.control()) for x in a] == [(1, "torch_empty_cache", {"op": "torch_empty_cache"})]
    assert t.evaluate(snap(30.0, *procs))[1] == ()  # cooling down
    assert len(t.evaluate(snap(61.0, *procs))[1]) == 1
    assert t.action_counts[("pod", "p", "torch_empty_cache")] == 2
    below = (proc(1, dev(0, GIB), info={"pod": "p"}),)
    assert t.evaluate(snap(200.0, *below))[1] == ()


def test_hard_action_sets_the_member_share_once() -> None:
    t = tracker({"scope": "process", "name": "9", "bytes": 14 * GIB, "hard_action": True})
    _, a = t.evaluate(snap(0.0, proc(9, dev(0, GIB)), gpus=H200))
    assert [x.control() for x in a] == [{"op": "torch_memory_fraction", "fraction": 0.1, "device": 0}]
    assert t.evaluate(snap(1.0, proc(9, dev(0, 2 * GIB)), gpus=H200))[1] == ()
    # unknown GPU size: PyTorch's fraction cannot be computed, nothing is sent
    t2 = tracker({"scope": "process", "name": "9", "bytes": 14 * GIB, "hard_action": True})
    assert t2.evaluate(snap(0.0, proc(9, dev(0, GIB))))[1] == ()


def test_zero_budget_hard_action_is_fraction_zero_and_exited_process_gets_nothing() -> None:
    t = tracker({"scope": "process", "name": "*", "bytes": 0, "hard_action": True, "soft_action": True})
    _, a = t.evaluate(snap(0.0, proc(9, dev(0, MIB)), proc(10, dev(0, MIB), exited=True), gpus=H200))
    assert sorted((x.pid, x.action) for x in a) == [(9, "torch_empty_cache"), (9, "torch_memory_fraction")]
    assert [x.control()["fraction"] for x in a if x.action == "torch_memory_fraction"] == [0.0]


def test_budget_rules_come_from_the_config_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.yaml"
    path.write_text("budgets:\n  rules:\n    - {scope: namespace, name: ml, fraction: 0.25, soft_action: true}\n")
    cfg = load_config(path, env={})
    (st,), _ = BudgetTracker(cfg.budgets, cfg.cost).evaluate(
        snap(0.0, proc(1, dev(0, GIB), info={"namespace": "ml"}), gpus=(GpuState(0, "NVIDIA H200"),)))
    assert st.budget_bytes == int(0.25 * cfg.cost.memory_bytes["H200"])  # size from the model table
