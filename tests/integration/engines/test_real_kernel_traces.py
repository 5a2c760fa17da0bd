"""The advisor on kernel traces recorded on the H200.

* h200_advisor_{eager,graph}.jsonl.gz: recorded with tests/gpu/record_kernel_traces.py (committed);
* h200_kernels_{train,graph}.gfp.gz: recorded by the probe (tests/gpu/workload.py, scenarios
  kernels_train and kernels_graph); skipped, naming the file, until they are committed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import DATA, replay_snapshots
from gpufootprint.abtest import load_policy, run_abtest
from gpufootprint.config import Config
from gpufootprint.engines.graph import DECISIONS, GraphPolicy, advise

ROOT = Path(__file__).resolve().parents[3]


def final_snapshot(name: str):  # type: ignore[no-untyped-def]
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"{Path('tests/data') / name} is not recorded yet (the probe's device run writes it)")
    return list(replay_snapshots(path, kernel_retention=1 << 20))[-1]


def by_stream(name: str, policy: GraphPolicy, reuse: float | None = None):  # type: ignore[no-untyped-def]
    snap = final_snapshot(name)
    r = {(p.pid, d.dev): reuse for p in snap.processes for d in p.devices} if reuse is not None else None
    return {d.stream: d for d in advise(snap, policy, reuse=r)}


def test_real_training_step_period_is_found_after_the_warm_up_step() -> None:
    # 12 AdamW steps of a 2-layer transformer: the first launches 48 more kernels (optimizer state);
    # every later step is the same 99 kernels
    d = by_stream("h200_advisor_eager.jsonl.gz", GraphPolicy(), reuse=1.0)
    assert (d[7].op_count, d[7].graph_kernels) == (99, 0) and d[7].steps >= 10
    assert d[7].decision == "keep" and d[7].reasons[1].startswith("fail: mean kernel duration")
    # 100 tiny add_ and one sleep kernel per step on the side stream: the step, not one add_
    assert d[45].op_count == 101 and d[45].steps == 12
    assert d[45].mean_kernel_seconds < 5e-6  # type: ignore[operator]
    assert d[45].gap_share > 0.9  # type: ignore[operator]  # launch bound: the stream waits, mostly


def test_real_graph_replays_are_recognised_and_eager_launches_are_not() -> None:
    d = by_stream("h200_advisor_graph.jsonl.gz", GraphPolicy())
    assert d[13].decision == "already_captured" and d[13].graph_kernels == 150  # 30 replays x 5 kernels
    assert d[7].graph_kernels == 0 and d[7].op_count == 5 and d[7].decision == "keep"


def test_launch_bound_policy_captures_what_the_default_keeps() -> None:
    policies = [load_policy(str(ROOT / "examples/policies" / f)) for f in ("treatment.yaml", "launch_bound.yaml")]
    report = run_abtest([str(DATA / "h200_advisor_eager.jsonl.gz")], policies, Config())
    rows = {r["stream"]: r["policies"] for r in report["rows"]}
    assert rows[45]["treatment"]["decision"] == "keep"
    assert rows[45]["launch_bound"]["decision"] == "capture"
    assert rows[45]["launch_bound"]["saved_us_per_step"] > 100  # 100 launch gaps of several us each


def test_probe_recorded_graph_replays_are_recognised_as_already_captured() -> None:
    snap = final_snapshot("h200_kernels_graph.gfp.gz")
    decisions = advise(snap, GraphPolicy(captured_share=0.4))
    assert decisions and all(d.decision in DECISIONS for d in decisions)
    assert sum(d.graph_kernels for d in decisions) > 0, "no kernel carried a graph id"
    assert any(d.decision == "already_captured" for d in decisions), [(d.stream, d.reasons) for d in decisions]


def test_probe_recorded_training_steps_have_a_detected_period() -> None:
    snap = final_snapshot("h200_kernels_train.gfp.gz")
    decisions = advise(snap, GraphPolicy())
    main = max(decisions, key=lambda d: d.kernels)
    assert main.kernels > 0 and main.graph_kernels == 0
    assert main.op_count is not None and main.steps >= 3, main.reasons
