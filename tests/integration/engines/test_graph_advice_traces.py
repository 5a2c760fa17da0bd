"""``abtest`` equals the live verdict on launch-window recordings, with NVML's busy samples beside them.

* A synthetic trace (built here): ten launches per 266 ms step in launch windows; with the daemon's
  ``/api/nvml`` document saved as ``TRACE.nvml.json`` the default policy captures, without it the
  minimum mean kernel duration stays unknown.
* The H200 recordings of tests/gpu/test_graph_advice_gpu.py, once they are in tests/data
  (``h200_graph_<loop>.gfp.gz``, ``.gfp.gz.nvml.json`` and ``graph_advice_<loop>.json``, the live
  results): ``abtest`` with the default policy gives each loop the verdict the default daemon gave
  live. Skipped until the files are there.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpufootprint.records import API_DTYPE, MEMORY_DTYPE, ApiRole, RecordKind
from gpufootprint.wire.framing import PREAMBLE, FrameType, encode_batch, encode_json, encode_watermark

from tests.conftest import cli_env

DATA = Path(__file__).parents[2] / "data"
US = 1_000


def _abtest(trace: Path, policy: Path) -> list[dict[str, object]]:
    run = subprocess.run([sys.executable, "-m", "gpufootprint", "abtest", str(trace), "--policy", str(policy),
                          "--json"], env=cli_env(), capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    return list(json.loads(run.stdout)["rows"])


def _matmul_like_trace(path: Path, pid: int = 4321, t0: int = 1_700_000_000 * 10**9) -> tuple[int, int]:
    """Two launch windows of 5 steps: 10 launches, then a 265 ms wait; returns the first step's span."""
    mem = np.zeros(1, MEMORY_DTYPE)
    mem["ts"], mem["op"], mem["mk"], mem["addr"], mem["bytes"], mem["pid"] = t0, 1, 3, 0x1000, 3 << 28, pid
    rows = []
    for w0 in (t0 + 10**9, t0 + 31 * 10**9):
        t = w0
        rows.append((ApiRole.SYNC, t, t + US))
        t += US
        for _ in range(5):
            for _ in range(10):
                rows.append((ApiRole.LAUNCH, t, t + 10 * US))
                t += 10 * US
            rows.append((ApiRole.SYNC, t, t + 265_000 * US))
            t += 265_000 * US
    api = np.zeros(len(rows), API_DTYPE)
    for i, (role, s, e) in enumerate(rows):
        api[i]["start"], api[i]["end"], api[i]["role"], api[i]["tid"], api[i]["pid"], api[i]["domain"] = \
            s, e, role, 9, pid, 5
    body = (PREAMBLE + encode_json(FrameType.HELLO, {"pid": pid, "start_time": 1})
            + encode_batch(RecordKind.MEMORY, mem) + encode_batch(RecordKind.API, api)
            + encode_watermark(int(api["end"].max()) + 1) + encode_json(FrameType.GOODBYE, {"pid": pid}))
    path.write_bytes(gzip.compress(body))
    return t0 + 10**9, int(api["end"].max())


def test_abtest_reads_the_daemons_nvml_samples_beside_a_trace_and_gives_the_live_verdict(tmp_path: Path) -> None:
    trace = tmp_path / "matmul_like.gfp.gz"
    start, end = _matmul_like_trace(trace)
    policy = tmp_path / "default.yaml"
    policy.write_text("{}\n")
    # WITHOUT NVML's samples: the mean kernel is at most ~26.5 ms, its minimum 0.5 ms unknown
    (row,) = _abtest(trace, policy)
    assert row["evidence"] == "launches" and row["op_count"] == 10, row
    assert row["policies"]["default"]["decision"] == "insufficient_data", row  # type: ignore[index]
    # WITH the daemon's /api/nvml document saved beside it (busy 97 % every sixth of a second)
    ts = range(start, end, 166_667 * US)
    doc = {"state": "ok", "process_busy": {"0": {"4321": [[t, 0.97] for t in ts]}}}
    Path(str(trace) + ".nvml.json").write_text(json.dumps(doc))
    (row,) = _abtest(trace, policy)
    assert row["policies"]["default"]["decision"] == "capture", row  # type: ignore[index]
    assert row["gpu_busy_ratio"] == pytest.approx(0.97) and 20 < row["mean_kernel_ms_min"] < 26.6, row  # type: ignore[operator]


def test_a_damaged_nvml_document_is_an_error_naming_the_file(tmp_path: Path) -> None:
    trace = tmp_path / "t.gfp.gz"
    _matmul_like_trace(trace)
    Path(str(trace) + ".nvml.json").write_text("{\"process_busy\": [1, 2]}")
    policy = tmp_path / "default.yaml"
    policy.write_text("{}\n")
    run = subprocess.run([sys.executable, "-m", "gpufootprint", "abtest", str(trace), "--policy", str(policy)],
                         env=cli_env(), capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode != 0 and "t.gfp.gz.nvml.json" in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("loop", ["matmul", "matmul2s", "tiny", "transformer"])
def test_abtest_on_the_h200_recording_equals_the_default_daemons_live_verdict(tmp_path: Path, loop: str) -> None:
    # recorded on the H200 (2026-12-03), the 2 s loop on an H100 (2026-12-06)
    trace = next((p for p in (DATA / f"h200_graph_{loop}.gfp.gz", DATA / f"h100_graph_{loop}.gfp.gz") if p.is_file()),
                 DATA / f"h200_graph_{loop}.gfp.gz")
    live = DATA / f"graph_advice_{loop}.json"
    if not (trace.is_file() and live.is_file()):
        pytest.skip(f"{trace.name} and {live.name} are not in tests/data yet (tests/gpu/test_graph_advice_gpu.py)")
    verdict = json.loads(live.read_text())["live_verdict"]
    policy = tmp_path / "default.yaml"
    policy.write_text("{}\n")
    rows = [r for r in _abtest(trace, policy) if r["pid"] == verdict["pid"]]
    assert [r["policies"]["default"]["decision"] for r in rows] == [verdict["decision"]], rows  # type: ignore[index]
    assert rows[0]["evidence"] == verdict["evidence"] == "launches" and rows[0]["op_count"] == verdict["op_count"]
