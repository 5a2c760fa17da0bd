"""The H200's live-through-failure recordings, replayed on the CPU (tests/gpu/test_live_failure_gpu.py
recorded them with the probe's tee, 2026-12-03).

Processes that caught their out-of-memory error and went on (PyTorch, CuPy, Numba, JAX with its
platform allocator and with its arena), and four PyTorch threads reusing each other's addresses
(caching off, cudaMallocAsync). At every quiet point the workload marked the framework's own figure
of what it held (``framework_held_bytes``); the replay must reach the probe's table at each mark and
the framework's figure, through the same pipeline as a live daemon.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gpufootprint.config import FootprintConfig
from gpufootprint.pipeline import Pipeline
from gpufootprint.replay import replay_file

from tests.conftest import DATA, cli_env

pytestmark = pytest.mark.integration

OOM = ["oom_torch", "oom_cupy", "oom_numba", "oom_jax_platform", "oom_jax_arena"]
THREADS = ["threads_nocache", "threads_async"]
#: The same test with caching off on another H200 (2026-12-07 13:31 UTC), the one run of seven there in which
#: CUPTI never wrote the release of one 2 MiB tensor a worker thread freed, and no later allocation reused
#: its address: the recording that the GPU test failed on.
LOST_RELEASE = "threads_nocache_lost_release"


def _replay(name: str) -> tuple[list[dict], Pipeline]:  # type: ignore[type-arg]
    pipeline = Pipeline(FootprintConfig())
    result = replay_file(DATA / f"h200_survive_{name}.gfp.gz", pipeline)
    assert result.problems == [], result.problems
    return result.marks, pipeline


def _quiet_points(marks: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    points = [m for m in marks if "framework_held_bytes" in m]
    assert points and all(m["matches"] is True for m in points), [(m["label"], m["matches"]) for m in points]
    return points


@pytest.mark.parametrize("name", OOM)
def test_a_survivor_of_its_oom_replays_to_the_frameworks_figure_at_every_quiet_point(name: str) -> None:
    marks, pipeline = _replay(name)
    points = _quiet_points(marks)
    assert [m["label"] for m in points] == ["baseline", "after_oom", "freed_half", "went_on", "end"]
    extra = {m["label"]: m["live_bytes"].get("device", 0) - m["framework_held_bytes"] for m in points}
    if name.startswith("oom_jax"):
        # JAX holds device memory of its own beside the arrays from its first compilation on, constant
        assert extra["baseline"] == 0 and len({v for k, v in extra.items() if k != "baseline"}) == 1, extra
        assert 0 < extra["end"] <= 1 << 20, extra
    else:
        assert set(extra.values()) == {0}, extra
    assert points[1]["framework_held_bytes"] > 100 << 30  # the GPU was full
    ooms = [m for m in marks if m["label"] == "oom"]
    if name == "oom_jax_arena":
        assert ooms == []  # JAX's arena stopped at its own limit: no CUDA call failed
    else:
        assert ooms and all(m["oom"]["dev_known"] is True for m in ooms)  # the process saw one GPU
        assert sum(int(m["oom"].get("failed_calls", 0)) for m in ooms) >= 1
        # each is stamped at the failure: after the baseline, before the program looked at what it held
        assert all(points[0]["ts"] < m["ts"] < points[1]["ts"] for m in ooms), [m["ts"] for m in ooms]
    assert dict(pipeline.errors.counts) == {}


@pytest.mark.parametrize("name", THREADS)
def test_threads_that_reuse_each_others_addresses_replay_exact_with_every_inversion_repaired(name: str) -> None:
    marks, pipeline = _replay(name)
    points = _quiet_points(marks)
    assert [m["label"] for m in points] == ["round_0", "round_1", "round_2", "end"]
    assert all(m["live_bytes"].get("device", 0) == m["framework_held_bytes"] for m in points), points
    # one release CUPTI never wrote stays one counted error; the quick frees of that address after it
    # are its new allocations' own (their calls came later) and none is taken for the lost one
    assert dict(pipeline.errors.counts) == {"double_allocation": 1}
    assert dict(pipeline.errors.repairs) == {}
    assert sum(pipeline.records_ingested.values()) > 100_000


def test_a_release_cupti_never_wrote_at_an_address_never_reused_stays_one_allocation_until_the_exit() -> None:
    """What the daemon can and cannot do with such a recording (docs/known-issues.md): nothing in the records
    says the tensor went, so its 2 MiB stay live from the quiet point after its free until the process ends,
    uncounted (no later record contradicts them); every other allocation of 95,000 is exact at every point.
    The recording itself holds one device allocation that no record releases: 0x7f697c600000, 2 MiB, stamped
    4 ms before round_1 (which it was part of), freed by a worker thread in round 2."""
    marks, pipeline = _replay(LOST_RELEASE)
    points = _quiet_points(marks)  # the replay reaches the probe's table: the probe saw no release either
    assert [m["label"] for m in points] == ["round_0", "round_1", "round_2", "end"]
    extra = [m["live_bytes"].get("device", 0) - m["framework_held_bytes"] for m in points]
    assert extra == [0, 0, 2 << 20, 2 << 20], extra  # exact until the free CUPTI never wrote, then 2 MiB
    assert dict(pipeline.errors.counts) == {} and dict(pipeline.errors.repairs) == {}
    (proc,) = pipeline.processes.values()
    assert proc.exited_at is not None and not proc.devices[0].live  # its exit ends it


def test_a_recordings_own_live_bytes_say_whose_loss_a_difference_at_a_quiet_point_is() -> None:
    """What the GPU test says when it fails: the records of the lost-release recording, applied in time order,
    leave that one 2 MiB allocation live at the end, as the daemon read; a daemon figure other than the
    records' is called the daemon's loss."""
    from tests.lost_releases import live_at, whose_loss

    path = DATA / f"h200_survive_{LOST_RELEASE}.gfp.gz"
    pid, live = live_at(path, "end")
    assert pid == 2587 and live == {0x7F697C600000: (2 << 20, live[0x7F697C600000][1])}, live
    assert live_at(path, "round_1")[1].get(0x7F697C600000) is not None  # PyTorch held it then
    assert "as the daemon read" in whose_loss(path, "end", 2 << 20, 0)
    assert "the daemon lost or misread" in whose_loss(path, "end", 0, 0)


def test_the_cli_replays_a_survivor_with_every_mark_equal(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    report = subprocess.run([sys.executable, "-m", "gpufootprint", "replay", str(DATA / "h200_survive_oom_cupy.gfp.gz"),
                             "--report-json", str(out)], env=cli_env(), capture_output=True, text=True, timeout=120, check=False)
    assert report.returncode == 0, report.stderr
    assert "0 differ" in report.stderr, report.stderr
    body = json.loads(out.read_text())
    assert all(m["matches"] for m in body["marks"] if m.get("expect_live_bytes") is not None)


def test_every_survive_recording_named_here_is_committed() -> None:
    """The lists above are the recordings: none may go missing (a parametrised test over files found
    on disk would pass with none)."""
    assert sorted(p.name for p in Path(DATA).glob("h200_survive_*.gfp.gz")) == sorted(
        f"h200_survive_{n}.gfp.gz" for n in [*OOM, *THREADS, LOST_RELEASE])
