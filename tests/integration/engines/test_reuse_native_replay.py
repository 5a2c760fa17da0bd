"""The daemon's path runs the reuse tracker's C core, and real traces replay to the same results with it
and without it (``GPUFOOTPRINT_DAEMON_NATIVE=0``): the marks, every device's reuse ratio, events and
count of allocations in the snapshot, and ``abtest``'s verdicts and reuse ratios for every policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gpufootprint import native
from gpufootprint.abtest import load_policy, run_abtest
from gpufootprint.config import FootprintConfig
from gpufootprint.configload import load_config
from gpufootprint.hub import FeatureHub
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data"
POLICIES = ROOT / "examples" / "policies"
# cudaMallocAsync under churn and at rest, a training loop, and a CUPTI-JSONL recording (read by other code)
TRACES = ("h200_probe_churn_async.gfp.gz", "h200_probe_async.gfp.gz", "h200_kernels_train.gfp.gz",
          "h200_advisor_eager.jsonl.gz")


def _replay(trace: Path) -> tuple[Any, ...]:
    pipeline = Pipeline(FootprintConfig(), hub=FeatureHub())
    result = replay_file(trace, pipeline)
    cores = {key: b.reuse._core is not None for key, b in pipeline.hub.builders.items()}
    snap = pipeline.snapshot(wall_time=0.0)
    reuse = {(f.pid, f.dev): (f.allocation_reuse_ratio, f.device_allocations,
                              None if f.reuse_events is None else f.reuse_events.tobytes()) for f in snap.features}
    rows = run_abtest([str(trace)], [load_policy(str(f)) for f in sorted(POLICIES.glob("*.yaml"))],
                      load_config(None, env={}))["rows"]
    return result.records, json.dumps(result.marks, sort_keys=True, default=str), cores, reuse, rows


@pytest.mark.parametrize("trace", TRACES)
def test_a_replay_gives_the_same_reuse_and_verdicts_with_the_c_core_and_without(
        trace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lib, why = native.load()
    assert lib is not None, why
    # GIVEN the trace replayed as the daemon replays it, with the C core (the default where it is built)
    monkeypatch.delenv(native.ENV, raising=False)
    records, marks, cores, reuse, rows = _replay(DATA / trace)
    # and with it switched off
    monkeypatch.setenv(native.ENV, "0")
    records_off, marks_off, cores_off, reuse_off, rows_off = _replay(DATA / trace)
    # THEN the first ran the C core on every device and the second none
    assert cores and all(cores.values()) and cores_off.keys() == cores.keys() and not any(cores_off.values())
    # and both gave the same marks, reuse and verdicts (and some device allocations were judged)
    assert records == records_off and marks == marks_off
    assert reuse == reuse_off and any(count > 0 for _, count, _ in reuse.values())
    assert rows == rows_off and rows


@pytest.mark.parametrize("turned_off", [False, True])
def test_a_daemon_says_whether_its_c_core_serves(daemons: Any, turned_off: bool) -> None:
    """An operator sees it in the log at start and on /metrics: without the core the same figures cost more CPU."""
    from tests.conftest import cli_env

    if native.load()[0] is None:
        pytest.fail(f"the C core did not load in this install: {native.load()[1]}")  # CI builds it: a real failure
    env = cli_env()
    env[native.ENV] = "0" if turned_off else "1"
    d = daemons("--set", "footprint.reorder_window_ms=0", env=env).ready()
    (labels, value), = d.metrics()["gpufootprint_build_info"]
    assert value == 1.0
    assert labels["native_core"] == ("false" if turned_off else "true")
    log = d.log()
    if turned_off:
        assert "daemon C core: not used (GPUFOOTPRINT_DAEMON_NATIVE=0)" in log, log
    else:
        assert "daemon C core: loaded" in log and "not used" not in log, log
