"""The live advisor and ``abtest`` give the same verdict on the same trace and policy.

Live: the trace is replayed into a running daemon (``App``, as ``gpufootprint replay
--listen`` does) whose configuration carries the policy, and /api/engines is read over
HTTP. Offline: ``run_abtest`` on the same file with the same policy file. The reuse
ratio in both comes from one definition (features.reuse), so the decisions, the
reuse ratios and the reasons must be identical.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpufootprint.abtest import load_policy, run_abtest
from gpufootprint.app import App
from gpufootprint.configload import load_config
from gpufootprint.replay import replay_file

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data"
POLICIES = ROOT / "examples" / "policies"
# The last: a default daemon's launch windows around a launch-bound loop (tests/gpu/test_graph_live_gpu.py,
# H200, 2026-12-03 10:01 UTC), judged from launch calls, not kernels
TRACES = ("h200_advisor_eager.jsonl.gz", "h200_advisor_graph.jsonl.gz", "h200_kernels_train.gfp.gz",
          "h200_kernels_graph.gfp.gz", "h200_graph_launches.gfp.gz")


def live_decisions(trace: Path, policy_file: Path, tmp_path: Path) -> list[dict[str, Any]]:
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"graph_advisor": yaml.safe_load(policy_file.read_text())}))
    app = App(load_config(cfg, env={}), socket_path=None, listen="127.0.0.1:0")
    app.start()
    try:
        result = replay_file(trace, app.pipeline, guard=app.ingest.lock)
        assert result.problems == []
        # The replay over, the loop stops as `replay` ends a run: its last tick applies and publishes everything.
        # (A busy loop, its share of a core above LoopLoad.CPU_ON, as under a parallel test run, builds a
        # snapshot at most every COALESCE_S: a tick right after one of its own would publish nothing new.)
        app.ingest.stop_event.set()
        app.ingest.tick()
        assert app.http is not None
        report = json.loads(urllib.request.urlopen(app.http.url.replace("/metrics", "/api/engines"),
                                                   timeout=10).read())
    finally:
        app.stop()
    return report["graph"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("trace", TRACES)
def test_live_verdict_equals_abtest_for_every_policy(trace: str, tmp_path: Path) -> None:
    path = DATA / trace
    files = sorted(POLICIES.glob("*.yaml"))
    assert [f.stem for f in files] == ["control", "launch_bound", "treatment"]
    offline = run_abtest([str(path)], [load_policy(str(f)) for f in files], load_config(None, env={}))
    for f in files:
        live = {(d["pid"], d["dev"], d["stream"]): d for d in live_decisions(path, f, tmp_path)}
        off = {(r["pid"], r["dev"], r["stream"]): r for r in offline["rows"]}
        assert live.keys() == off.keys() and live, (trace, f.stem)
        for key, d in live.items():
            row = off[key]
            assert d["decision"] == row["policies"][f.stem]["decision"], (trace, f.stem, key)
            assert d["reasons"] == row["policies"][f.stem]["reasons"], (trace, f.stem, key)
            assert d["reuse_ratio"] == row["reuse_ratio"]
    # the reuse ratio is known wherever the process made device allocations: no "unknown" verdicts
    assert not any(r["reuse_ratio"] is None and r["kernels"] for r in offline["rows"]), offline["rows"]


def test_the_real_launch_windows_of_a_launch_bound_loop_are_captured_only_by_the_launch_bound_policy() -> None:
    # 100 tiny add_ launches and a small MLP per step, a wait each step: 113 launch calls a step, the
    # mean kernel at most 0.026 ms (H200); the seed's control and treatment ask for kernels of 0.5 ms
    # and more, the launch-bound policy for at most 0.05 ms
    files = sorted(POLICIES.glob("*.yaml"))
    report = run_abtest([str(DATA / "h200_graph_launches.gfp.gz")], [load_policy(str(f)) for f in files],
                        load_config(None, env={}))
    (row,) = report["rows"]
    assert row["evidence"] == "launches" and row["op_count"] == 113 and row["stream"] is None
    assert row["mean_kernel_ms_max"] < 0.05
    assert {k: v["decision"] for k, v in row["policies"].items()} == {
        "control": "keep", "launch_bound": "capture", "treatment": "keep"}
