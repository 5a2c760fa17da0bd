"""The advisor on kernel traces recorded on the H200 by the probe (tests/gpu/workload.py
scenarios kernels_train and kernels_graph). Skipped, naming the file, until they are committed."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import DATA, replay_snapshots

from gpufootprint.engines.graph import DECISIONS, GraphPolicy, advise


def final_snapshot(name: str):  # type: ignore[no-untyped-def]
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"{Path('tests/data') / name} is not recorded yet (the probe's device run writes it)")
    return list(replay_snapshots(path, kernel_retention=1 << 20))[-1]


def test_graph_replays_are_recognised_as_already_captured() -> None:
    snap = final_snapshot("h200_kernels_graph.gfp.gz")
    decisions = advise(snap, GraphPolicy(captured_share=0.4))
    assert decisions and all(d.decision in DECISIONS for d in decisions)
    assert sum(d.graph_kernels for d in decisions) > 0, "no kernel carried a graph id"
    assert any(d.decision == "already_captured" for d in decisions), [(d.stream, d.reasons) for d in decisions]


def test_training_steps_have_a_detected_period() -> None:
    snap = final_snapshot("h200_kernels_train.gfp.gz")
    decisions = advise(snap, GraphPolicy())
    main = max(decisions, key=lambda d: d.kernels)
    assert main.kernels > 0 and main.graph_kernels == 0
    assert main.op_count is not None and main.steps >= 3, main.reasons
    assert main.decision in ("capture", "keep", "insufficient_data")
