"""How the suite runs: in parallel by default, and the GPU tests in one process (one GPU, tests that fill it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path = ROOT, codes: tuple[int, ...] = (0,)) -> str:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode in codes, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout + r.stderr


def test_a_run_of_gpu_test_files_alone_stays_in_one_process() -> None:
    """On 2026-12-06 `pytest tests/gpu/<files>` (no `-m gpu`) ran on four workers on the H100, and the OOM
    tests' workloads filled the one GPU beside each other: four failed that way."""
    out = _run("tests/gpu/test_nvml_live.py", "tests/gpu/test_torch_figures_gpu.py")
    assert "bringing up nodes" not in out and "[gw" not in out, out[-2000:]


def test_gpu_test_files_named_from_another_directory_stay_in_one_process_too() -> None:
    """The paths are the command line's, relative to where pytest was started: `gpu` from tests/, a file
    from tests/gpu/ (`-k` selects none of them: only the choice of processes is looked at)."""
    for cwd, args in ((ROOT / "tests", ["gpu"]), (ROOT / "tests", ["./gpu/test_nvml_live.py"]),
                      (ROOT / "tests" / "gpu", ["test_nvml_live.py"]), (ROOT / "tests" / "gpu", ["."])):
        out = _run("-k", "no_such_test", *args, cwd=cwd, codes=(5,))  # 5: no test ran
        assert "bringing up nodes" not in out and "[gw" not in out, (cwd, args, out[-2000:])


def test_a_run_of_other_files_still_goes_parallel() -> None:
    out = _run("tests/unit/test_probecounters.py")
    assert "bringing up nodes" in out, out[-2000:]
