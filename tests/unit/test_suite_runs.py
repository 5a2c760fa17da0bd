"""How the suite runs: in parallel by default, and the GPU tests in one process (one GPU, tests that fill it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout + r.stderr


def test_a_run_of_gpu_test_files_alone_stays_in_one_process() -> None:
    """On 2026-12-06 `pytest tests/gpu/<files>` (no `-m gpu`) ran on four workers on the H100, and the OOM
    tests' workloads filled the one GPU beside each other: four failed that way."""
    out = _run("tests/gpu/test_nvml_live.py", "tests/gpu/test_torch_figures_gpu.py")
    assert "bringing up nodes" not in out and "[gw" not in out, out[-2000:]


def test_a_run_of_other_files_still_goes_parallel() -> None:
    out = _run("tests/unit/test_probecounters.py")
    assert "bringing up nodes" in out, out[-2000:]
